#!/usr/bin/env python
"""The fused MoE experts kernels (`target.experts=fused`) across launch shapes: which tiles make a
layer's routed experts fastest on this GPU.

    python scripts/bench_experts.py [--shape qwen3_next] [--tokens 12288] [--block-m 64,128]
        [--fp8] [--repeat 20] [--warmup 3]

One MoE layer's experts at a preset's published shape (`qwen3_next`: Qwen3-Next-80B-A3B, 512
experts of 2048 -> 512, top 10; `qwen3_5_35b`: Qwen3.5-35B-A3B, 256 experts, top 8), bf16 weights
(`--fp8`: e4m3 with 128 x 128 block scales, as published), random hidden states and a random
top-k per token (uniform over experts: a trained router is more skewed, so real tiles are fuller
for some experts and emptier for others). For each row tile (`--block-m`, the padding of each
expert's run of rows), first the gate/up kernel's tiles are swept with the down kernel at its
default, then the down kernel's with the gate/up kernel at the best found. Rows: median
milliseconds of the whole experts call (routing, both kernels, the per-token sum; CUDA events)
over --repeat calls after --warmup, useful TFLOP/s (tokens x top_k x 6 x hidden x intermediate),
and the largest difference from the default tiles' output (the same products summed in another
order: bf16 rounding, not a wrong tile). The last lines give the default (the tiles a target on this
GPU runs with) and the best tiling, each timed again back to back with three times the calls, and
the override that trains with the best (`target.experts_tiling=...`, for dflash-train and
scripts/bench_target.py).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.target.experts_tiling import (  # noqa: E402
    FP8_BLOCK,
    ExpertsTiling,
    KernelTiling,
    default_tiling,
    shared_memory_limit,
)
from dflash.target.fp8 import quantize_blockwise  # noqa: E402
from dflash.target.fused_experts import fused_experts  # noqa: E402
from dflash.tools.timing import median_ms  # noqa: E402


@dataclass(frozen=True)
class ExpertsShape:
    experts: int
    hidden: int
    inter: int
    top_k: int


SHAPES = {
    "qwen3_next": ExpertsShape(experts=512, hidden=2048, inter=512, top_k=10),
    "qwen3_5_35b": ExpertsShape(experts=256, hidden=2048, inter=512, top_k=8),
}
# What each kernel's tiles are swept over (every combination that `ExpertsTiling.refusal` allows).
BLOCK_N = (64, 128, 256)
BLOCK_K = (64, 128)
WARPS = (4, 8)
STAGES = (3, 4)


def candidates() -> list[KernelTiling]:
    return [
        KernelTiling(block_n=n, block_k=k, warps=w, stages=s)
        for n, k, w, s in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_next")
    parser.add_argument("--tokens", type=int, default=12288, help="tokens per layer call (4 x 3072)")
    parser.add_argument("--block-m", default="64,128", help="row tiles to try, comma-separated")
    parser.add_argument("--fp8", action="store_true", help="block-wise FP8 expert weights, as published")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_experts: the fused experts kernels need CUDA; no GPU is visible", file=sys.stderr)
        raise SystemExit(2)
    from triton.runtime.errors import OutOfResources

    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device, dtype=torch.bfloat16)

    x = randn(args.tokens, shape.hidden)
    gate_up = randn(shape.experts, 2 * shape.inter, shape.hidden) * shape.hidden**-0.5
    down = randn(shape.experts, shape.hidden, shape.inter) * shape.inter**-0.5
    logits = torch.rand(args.tokens, shape.experts, generator=generator, device=device)
    top_weights, top_index = logits.topk(shape.top_k, dim=-1)
    top_weights = top_weights.softmax(dim=-1).to(torch.bfloat16)
    weights = dict(gate_up_proj=gate_up, down_proj=down)
    if args.fp8:
        block = (FP8_BLOCK, FP8_BLOCK)
        (gate_up_q, gate_up_s), (down_q, down_s) = (quantize_blockwise(w, block) for w in (gate_up, down))
        weights = dict(gate_up_proj=gate_up_q, down_proj=down_q, gate_up_scale=gate_up_s, down_scale=down_s)
    flops = args.tokens * shape.top_k * 6 * shape.hidden * shape.inter

    def call(tiling: ExpertsTiling) -> torch.Tensor:
        return fused_experts(x, top_index, top_weights, **weights, tiling=tiling)

    # the tiles a target on this GPU runs with unless told otherwise
    weights_dtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
    default = default_tiling(
        weights_dtype, activations=torch.bfloat16, shared_memory=shared_memory_limit(device)
    )
    reference = call(default)
    print(
        f"{args.shape}: {shape.experts} experts {shape.hidden} -> {shape.inter}, top {shape.top_k}, "
        f"{args.tokens} tokens, {'FP8 block-wise' if args.fp8 else 'bf16'} weights, "
        f"{torch.cuda.get_device_name()}"
    )
    print(
        f"{'block_m':>7} {'kernel':>8} {'N':>4} {'K':>4} {'warps':>5} {'stages':>6} {'ms':>8} {'TFLOP/s':>8} {'max |diff|':>10}"
    )

    def row(tiling: ExpertsTiling, kernel: str, tiles: KernelTiling, figures: str) -> None:
        print(
            f"{tiling.block_m:>7} {kernel:>8} {tiles.block_n:>4} {tiles.block_k:>4} {tiles.warps:>5} "
            f"{tiles.stages:>6} {figures}"
        )

    def measure(tiling: ExpertsTiling, kernel: str, tiles: KernelTiling) -> float | None:
        if tiling.refusal(args.fp8) is not None:
            return None
        try:
            out = call(tiling)
        except OutOfResources:  # tiles whose stages do not fit in shared memory: skipped
            needed = tiling.shared_memory(activations=torch.bfloat16, weights=weights_dtype) // 1024
            row(tiling, kernel, tiles, f"  not run: out of shared memory (counted: {needed} KiB)")
            return None
        diff = (out.float() - reference.float()).abs().max().item()
        ms = median_ms(lambda: call(tiling), warmup=args.warmup, repeat=args.repeat, device=device)
        row(tiling, kernel, tiles, f"{ms:>8.3f} {flops / ms / 1e9:>8.1f} {diff:>10.2e}")
        return ms

    default_ms = measure(default, "default", default.gate_up)

    def tried(tiling: ExpertsTiling, kernel: str, tiles: KernelTiling) -> tuple[ExpertsTiling, float | None]:
        return tiling, measure(tiling, kernel, tiles)

    best, best_ms = default, default_ms
    for block_m in (int(size) for size in args.block_m.split(",")):
        start = replace(default, block_m=block_m)
        timed = [tried(replace(start, gate_up=tiles), "gate_up", tiles) for tiles in candidates()]
        start = min((t for t in timed if t[1] is not None), key=lambda t: t[1])[0]
        timed += [tried(replace(start, down=tiles), "down", tiles) for tiles in candidates()]
        best, best_ms = min([(best, best_ms), *(t for t in timed if t[1] is not None)], key=lambda t: t[1])

    # The sweep's minimum is the luckiest of many single medians: the default and the best are timed
    # again, one after the other, with three times the calls, and the ratio comes from those.
    def retimed(tiling: ExpertsTiling) -> float:
        return median_ms(lambda: call(tiling), warmup=args.warmup, repeat=3 * args.repeat, device=device)

    default_ms, best_ms = retimed(default), retimed(best)
    print(f"default: {default} {default_ms:.3f} ms, {flops / default_ms / 1e9:.1f} TFLOP/s (timed again)")
    print(
        f"best:    {best} {best_ms:.3f} ms, {flops / best_ms / 1e9:.1f} TFLOP/s ({default_ms / best_ms:.2f}x; timed again)"
    )
    print(f"override: '{best.override()}'")


if __name__ == "__main__":
    main()
