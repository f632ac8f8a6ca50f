#!/usr/bin/env python
"""The drafter's training attention alone: flex_attention forward and backward at the paper's
shape under several kernel configurations, side by side in one run.

    python scripts/bench_flex.py [--context 3072] [--anchors 512] [--block 16] [--repeat 10]
        [--configs default,autotune,bwd64x64,...]

At the paper's shape the compiled drafter step spends ~23 ms in flex_attention's backward
against ~4.7 ms in its forward (benchmarks/RESULTS.md): the backward kernel's tile sizes are
torch's per-architecture default, not tuned for this mask (one query tile sees the context
before its anchors plus one partly visible tile of its own blocks). This script times the
attention alone (queries 32 heads x anchors*block, keys 8 heads x context + anchors*block,
head dim 128, bf16; the mask of `dflash.step.block_mask` from anchors drawn as training draws them)
for each named configuration of `kernel_options` (what `drafter.flex_kernel_options` passes),
plus `autotune`: inductor's max-autotune search over its own candidate list, which logs the
winner ("AUTOTUNE ..." lines). Every row's output and gradients are compared with the first
row's, so a configuration that computes something else shows.

Useful FLOPs count only the (query, key) pairs a query may see: the context before its anchor
plus its own block; forward 4 flops per pair and head dim, backward twice that (the recomputed
scores are not counted).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.step.block_mask import flex_block_mask, kv_tiles  # noqa: E402
from dflash.step.blocks import sample_anchors  # noqa: E402
from dflash.tools.timing import median_ms  # noqa: E402

# name -> kernel_options. Forward keys (fwd_ prefix): BLOCK_M, BLOCK_N, num_stages, num_warps;
# backward keys (bwd_ prefix): BLOCK_M1/N1 (the dK/dV kernel: N1 keys per program, M1 queries
# per step), BLOCK_M2/N2 (the dQ kernel), num_stages, num_warps. Torch strips each prefix for its
# own kernel and drops the other's. The sparse tiles are 128, so every block size divides 128.
CONFIGS: dict[str, dict | None] = {
    "default": {},
    "autotune": None,  # max-autotune picks from inductor's list
    "bwd64x64_s3w4": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
    "bwd32x128_s3w4": {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 3,
        "bwd_num_warps": 4,
    },
    "bwd64x128_s2w8": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 64,
        "bwd_num_stages": 2,
        "bwd_num_warps": 8,
    },
    "bwd32x64_s4w4": {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 64,
        "bwd_BLOCK_M2": 64,
        "bwd_BLOCK_N2": 32,
        "bwd_num_stages": 4,
        "bwd_num_warps": 4,
    },
    "fwd128x128_s2w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=3072, help="context tokens per sample")
    parser.add_argument("--supervised-from", type=int, default=64, help="first supervised position")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--dynamic",
        action="store_true",
        help="compile with symbolic shapes (dynamic=True, as the drafter's training graph by default)",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {list(CONFIGS)}")
    return parser.parse_args()


def attention_calls(compiled, options: dict, qkv, mask, grad_out):
    """(forward, forward + backward) of one compiled configuration on fixed inputs."""
    q, k, v = qkv

    def forward():
        return compiled(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=dict(options))

    def forward_backward():
        out = forward()
        q.grad = k.grad = v.grad = None
        out.backward(grad_out)
        return out

    return forward, forward_backward


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_flex.py times CUDA kernels: run it on a GPU")
    names = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        sys.exit(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    device = torch.device("cuda")
    loss_mask = np.zeros(args.context, dtype=np.uint8)
    loss_mask[args.supervised_from :] = 1
    anchors = sample_anchors(loss_mask, args.anchors, np.random.default_rng(0))[None]
    valid = np.ones_like(anchors, dtype=bool)
    tiles = kv_tiles(anchors, valid, args.context, args.block).to(device)
    anchors_t, valid_t = torch.from_numpy(anchors).to(device), torch.from_numpy(valid).to(device)
    mask = flex_block_mask(tiles, anchors_t, valid_t, args.context, args.block)
    q_len, kv_len = tiles.q_len, tiles.kv_len
    pairs = float(((anchors + args.block) * args.block).sum())  # context before the anchor + own block
    forward_flops = 4 * pairs * args.head_dim * args.heads
    density = pairs / (q_len * kv_len)

    generator = torch.Generator(device=device).manual_seed(0)

    def rand(heads: int, length: int) -> torch.Tensor:
        x = torch.randn(
            1, heads, length, args.head_dim, device=device, generator=generator, dtype=torch.bfloat16
        )
        return x.requires_grad_(True)

    q, k, v = rand(args.heads, q_len), rand(args.kv_heads, kv_len), rand(args.kv_heads, kv_len)
    grad_out = torch.randn(
        1, args.heads, q_len, args.head_dim, device=device, dtype=torch.bfloat16, generator=generator
    )
    print(
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · "
        f"queries {q_len} x {args.heads} heads, keys {kv_len} x {args.kv_heads} heads, "
        f"head dim {args.head_dim}, bf16 · "
        f"visible pairs {density:.1%} of the dense mask · "
        f"{'symbolic' if args.dynamic else 'exact'} shapes · median of {args.repeat}"
    )
    print()
    columns = ["config", "forward ms", "forward TFLOP/s", "backward ms", "backward TFLOP/s", "fwd+bwd ms"]
    print("| " + " | ".join(columns + ["out diff", "grad diff"]) + " |")
    print("|---|---|---|---|---|---|---|---|")
    reference = None
    for name in names:
        options = CONFIGS[name]
        torch._dynamo.reset()
        if options is None:
            compiled = torch.compile(flex_attention, dynamic=args.dynamic, mode="max-autotune-no-cudagraphs")
            options = {}
        else:
            compiled = torch.compile(flex_attention, dynamic=args.dynamic)

        forward, forward_backward = attention_calls(compiled, options, (q, k, v), mask, grad_out)
        try:
            out = forward_backward()
        except Exception as error:  # a configuration the kernel cannot take (shared memory, ...)
            print(
                f"| {name} | failed: {type(error).__name__}: {str(error).splitlines()[0][:120]} | | | | | | |"
            )
            continue
        grads = [t.grad.detach().clone() for t in (q, k, v)]
        if reference is None:
            reference = (out.detach().clone(), grads)
        out_diff = rel_diff(out, reference[0])
        grad_diff = max(rel_diff(g, r) for g, r in zip(grads, reference[1]))
        with torch.no_grad():
            fwd_ms = median_ms(forward, warmup=args.warmup, repeat=args.repeat, device=device)
        both_ms = median_ms(forward_backward, warmup=args.warmup, repeat=args.repeat, device=device)
        bwd_ms = both_ms - fwd_ms
        print(
            f"| {name} | {fwd_ms:.2f} | {forward_flops / fwd_ms / 1e9:.0f} | {bwd_ms:.2f} | "
            f"{2 * forward_flops / bwd_ms / 1e9:.0f} | {both_ms:.2f} | {out_diff:.1e} | {grad_diff:.1e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
