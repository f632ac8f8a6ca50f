#!/usr/bin/env python
"""Time, FLOP rate and memory of one training step's phases, side by side in one run.

    python scripts/bench_step.py [--samples 1] [--seq-len 3072] [--context 64] [--repeat 5]
        [--drafter-variants reference,fused,flex,compiled]
        [--target-variants eager,compiled[,compiled_static]]
        [hydra overrides ...]

Defaults: a random Qwen3-8B-shaped target built on the GPU (target=qwen3_8b_random), the paper's
b16 drafter (drafter=b16, 512 anchors), one sample of 3072 tokens supervised from position 64.
Every override of dflash-train applies (drafter.num_layers=3, target.arch.num_hidden_layers=8 ...).

Phases (CUDA events; median of --repeat isolated calls after --warmup; a drafter row's notes
add the mean over --repeat steps issued back to back, as training issues them):
- target features: the frozen target's decoder stack up to its deepest feature layer, no LM
  head (what the target worker runs): `eager`, `compiled` (dynamic shapes, as
  `target.compile=true` trains) and `compiled_static` (torch's default: shapes fixed until one
  changes);
- drafter step: blocks -> forward -> loss -> backward -> clip -> fused AdamW (`DrafterStep`, the
  object training runs), one row per variant: `reference` (SDPA with the dense mask, full
  logits through autograd, eager), `fused` (+ the chunked LM-head loss), `flex` (+ block-sparse
  flex_attention), `compiled` (+ torch.compile of the drafter: the CUDA default). Its notes
  also give the first step's wall time, the graphs' compile included (`drafter.compile_scope`
  changes it; Inductor's caches shorten it on a second run unless TORCHINDUCTOR_CACHE_DIR is new).

Useful FLOPs count only what a position may see: the target's causal attention counts each
query's keys up to itself (and a MoE target only the experts a token is routed to); a block query counts the context before its anchor plus its block.
Backward counts twice the forward's matmuls for trained weights, once for frozen ones (the LM
head and the target features need no weight gradient). MFU = useful FLOP/s over the device's
dense bf16 peak. "peak extra" = peak allocated during the phase minus what was allocated before
it (weights and optimizer state stay resident; gradients and activations are extra).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.data.collate import Batch  # noqa: E402
from dflash.data.scheduler import PlannedBatch  # noqa: E402
from dflash.run.inputs import script_target  # noqa: E402
from dflash.run.launch import step_fn_for  # noqa: E402
from dflash.step.build import build_drafter, build_variant, compile_drafter  # noqa: E402
from dflash.step.step_paths import STEP_VARIANTS  # noqa: E402
from dflash.target.model import FrozenTarget  # noqa: E402
from dflash.target.target_head import TargetHead  # noqa: E402
from dflash.tools.compose import compose_typed, device_default, with_defaults  # noqa: E402
from dflash.tools.kernel_profile import write_kernel_table  # noqa: E402
from dflash.tools.target_cost import part_flops  # noqa: E402
from dflash.tools.timing import back_to_back_ms, median_ms  # noqa: E402
from dflash.torch_runtime.compile import CompileCounter  # noqa: E402

DEFAULTS = ["target=qwen3_8b_random", "drafter=b16", "drafter.mask_token_id=151669"]
DENSE_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


@dataclass
class Timing:
    median_s: float
    peak_extra_bytes: int


def time_phase(fn, *, warmup: int, repeat: int, device: torch.device) -> Timing:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return Timing(median_ms(fn, warmup=0, repeat=repeat, device=device) / 1e3, 0)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    seconds = median_ms(fn, warmup=0, repeat=repeat, device=device) / 1e3
    return Timing(seconds, torch.cuda.max_memory_allocated(device) - base)


def linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def target_flops(target: FrozenTarget, batch: int, seq_len: int) -> float:
    """The feature stack's useful FLOPs (dflash/tools/target_cost.py: the routed experts a token
    uses, causal attention in full-attention layers, the DeltaNet recurrence); no LM head."""
    return sum(part_flops(target, batch=batch, seq_len=seq_len).values())


def drafter_flops(
    drafter,
    head: TargetHead,
    *,
    blocks_visible: float,
    block_tokens: int,
    labelled: int,
    ctx_tokens: int,
    target_positions: int = 0,
) -> float:
    """Forward + backward of the drafter step. Trained weights: forward + 2x backward; the
    frozen LM head: forward + input gradient, on the `labelled` positions only (the others,
    block position 0 among them, carry no loss); fc sees target features (no input gradient).
    blocks_visible: the (query, key) pairs the draft layers may attend, all layers summed.
    DSpark: the LM head's forward on the target's final state at each distinct position the
    labelled rows read (`target_positions`), and the Markov head's rank-r projection to the
    vocabulary at the labelled rows (forward + both gradients; its W1 is a lookup)."""
    config = drafter.config
    per_layer_block = sum(
        linear_params(m)
        for layer in drafter.layers
        for m in (layer.mlp, layer.self_attn.q_proj, layer.self_attn.o_proj)
    )
    # DFlash2: each convolution's kernel projection runs at every block position; the selector's
    # hidden projection at the labelled ones (its K x rank codebook products are left out: small).
    per_layer_block += sum(
        linear_params(conv.kernel_projection)
        for layer in drafter.layers
        for conv in (layer.attention_conv, layer.mlp_conv)
        if conv is not None
    )
    selector = getattr(drafter, "candidate_selector", None)
    selector_forward = 0 if selector is None else 2 * linear_params(selector.hidden_projection) * labelled
    kv = sum(
        linear_params(layer.self_attn.k_proj) + linear_params(layer.self_attn.v_proj)
        for layer in drafter.layers
    )
    forward = (
        2 * (per_layer_block + kv) * block_tokens
        + 2 * kv * ctx_tokens
        + 2 * linear_params(drafter.fc) * ctx_tokens
    )
    attention = 4 * config.num_attention_heads * config.head_dim * blocks_visible  # summed over layers
    lm_head = 2 * head.lm_head.weight.numel() * labelled
    markov = getattr(drafter, "markov_head", None)
    markov_w2 = 0 if markov is None else 2 * markov.markov_w2.weight.numel() * labelled
    target_head = 2 * head.lm_head.weight.numel() * target_positions
    return 3 * (forward + selector_forward + markov_w2) + 3 * attention + 2 * lm_head + target_head


def make_batch(samples: int, seq_len: int, context: int, vocab: int, exclude: int, index: int) -> Batch:
    rng = np.random.default_rng(index)
    ids = rng.integers(0, vocab - 1, size=(samples, seq_len))
    ids[ids == exclude] = 0
    loss_mask = np.zeros((samples, seq_len), dtype=np.uint8)
    loss_mask[:, context:] = 1
    plan = PlannedBatch(epoch=0, index=index, bucket=0, sample_ids=tuple(range(samples)))
    return Batch(
        torch.from_numpy(ids),
        torch.from_numpy(loss_mask),
        torch.full((samples,), seq_len, dtype=torch.int64),
        plan,
    )


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DENSE_BF16_PEAK_TFLOPS.items() if key in name), None)


def row(name: str, timing: Timing, flops: float, peak: float | None, extra: str = "") -> str:
    rate = flops / timing.median_s / 1e12  # useful TFLOP/s
    mfu = f"{rate / peak:.0%}" if peak else "n/a"
    memory = f"{timing.peak_extra_bytes / 2**30:.1f} GiB" if timing.peak_extra_bytes else "n/a"
    return f"| {name} | {timing.median_s * 1e3:.1f} ms | {rate:.3g} | {mfu} | {memory} | {extra} |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--context", type=int, default=64, help="unsupervised prefix of each sample")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--drafter-variants", default=",".join(STEP_VARIANTS))
    parser.add_argument("--target-variants", default="eager,compiled")
    parser.add_argument("--profile", help="a directory: each drafter variant's kernel table (torch.profiler)")
    args, overrides = parser.parse_known_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = with_defaults([*DEFAULTS, device_default()], overrides)
    cfg = compose_typed(base)
    target, layer_ids = script_target(cfg, device, "bench_step")  # a GGUF target.path: converted once
    head = TargetHead.of(target)
    peak = peak_tflops(device)
    vocab = target.config.vocab_size
    batch = make_batch(args.samples, args.seq_len, args.context, vocab, cfg.drafter.mask_token_id, 0)
    ids = batch.input_ids.to(device)
    print(
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}; "
        f"overrides: {' '.join(base)}; {args.samples} x {args.seq_len} tokens, supervised from {args.context}; "
        f"median of {args.repeat} after {args.warmup} warm-up",
        flush=True,
    )
    table = [
        "| phase | time | useful TFLOP/s | MFU | peak extra memory | notes |",
        "|---|---|---|---|---|---|",
    ]

    def show(line: str) -> None:
        table.append(line)
        print("\n".join(table), flush=True)  # the table so far: a later variant's crash loses nothing

    features = target.features(ids)
    for variant in [v for v in args.target_variants.split(",") if v]:
        counter = CompileCounter("target features")
        if variant == "compiled":
            target.compile_features(counter)  # target.compile=true with the default compile_dynamic
        elif variant == "compiled_static":
            torch._dynamo.reset()  # else the dynamic-shape graph above would serve this shape
            target.compile_features(counter, dynamic=None)
        elif variant != "eager":
            raise SystemExit(f"--target-variants: unknown {variant!r} (eager, compiled, compiled_static)")
        timing = time_phase(
            lambda: target.features(ids), warmup=args.warmup, repeat=args.repeat, device=device
        )
        relative = ((target.features(ids) - features).norm() / features.norm()).item()
        note = f"|diff| / |eager| {relative:.1e}" + (
            f"; {counter.graphs} graphs compiled" if counter.graphs else ""
        )
        show(
            row(
                f"target features ({variant})",
                timing,
                target_flops(target, args.samples, args.seq_len),
                peak,
                note,
            )
        )

    reference_loss = None
    for variant in [v for v in args.drafter_variants.split(",") if v]:
        variant_cfg = compose_typed(base + STEP_VARIANTS[variant])
        drafter = build_drafter(
            variant_cfg.drafter, target.config, layer_ids, str(device), build_variant(variant_cfg.variant)
        )
        counter = CompileCounter(f"drafter ({variant})")
        if variant_cfg.drafter.compile:
            torch._dynamo.reset()  # each variant compiles its own graphs
            compile_drafter(drafter, variant_cfg.drafter, counter)
        step_fn = step_fn_for(variant_cfg, head=head, drafter=drafter, total_steps=10**6, num_buckets=1)
        blocks_visible, block_tokens, labelled, target_positions = visible_keys(step_fn, batch)
        started = time.perf_counter()  # the first step: its graphs' compile included
        stats, _ = step_fn.forward_backward(batch, features, 0)  # the loss at the initial weights
        loss = (stats.weighted_ce / stats.weight).item()
        step_fn.apply(stats.weight)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first_step_s = time.perf_counter() - started
        reference_loss = reference_loss if reference_loss is not None else loss
        steps = iter(range(1, 10**6))
        timing = time_phase(
            lambda s=step_fn, n=steps: s(batch, features, next(n)),
            warmup=args.warmup,
            repeat=args.repeat,
            device=device,
        )
        flops = drafter_flops(
            drafter,
            head,
            blocks_visible=blocks_visible,
            block_tokens=block_tokens,
            labelled=labelled,
            ctx_tokens=args.samples * args.seq_len,
            target_positions=target_positions,
        )
        # The table's time is per isolated step (the device waits for the host at each start);
        # a training loop issues its steps back to back.
        steady = back_to_back_ms(
            lambda s=step_fn, n=steps: s(batch, features, next(n)), repeat=args.repeat, device=device
        )
        note = (
            f"loss at init {loss:.5f} (vs first row {loss - reference_loss:+.1e}); {block_tokens} block tokens; "
            f"back to back {steady:.1f} ms/step"
        )
        if counter.graphs:
            note += f"; {counter.graphs} graphs compiled"
        note += f"; first step {first_step_s:.1f} s"
        show(row(f"drafter step ({variant})", timing, flops, peak, note))
        if args.profile:
            write_kernel_table(
                lambda s=step_fn, n=steps: s(batch, features, next(n)), Path(args.profile) / f"{variant}.txt"
            )
        del drafter, step_fn
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def visible_keys(step_fn, batch: Batch) -> tuple[float, int, int, int]:
    """Keys the block queries may see, summed over queries and draft layers (the context before
    the anchor, inside the window of a sliding layer, plus the query's block), the block tokens,
    the labelled positions (the LM head's rows) and, for DSpark, the distinct positions of the
    target distributions they read, for the anchors this step draws."""
    from dflash.step.step import make_blocks

    drafter = step_fn.drafter
    blocks = make_blocks(batch, drafter, step_fn.block_settings, keep_fraction=0.0)
    valid = blocks.anchor_valid.numpy()
    anchors = blocks.anchors.numpy()[:, :, None]  # [B, A, 1]
    offsets = np.arange(blocks.block_size)[None, None, :]
    visible = 0.0
    for window in drafter.layer_windows:
        sees_from = 0 if window is None else np.maximum(anchors + offsets - window + 1, 0)
        context = np.maximum(anchors - sees_from, 0) * valid[:, :, None]
        visible += float(context.sum()) + blocks.block_size * blocks.block_size * int(valid.sum())
    # DSpark: the distinct positions whose target distribution the labelled rows read.
    target_positions = 0 if blocks.final_positions is None else len(blocks.final_positions)
    return visible, int(valid.sum()) * blocks.block_size, len(blocks.loss_rows), target_positions


if __name__ == "__main__":
    main()
