#!/usr/bin/env python
"""The target's feature forward, side by side across expert kernels and samples per forward,
with the time of each layer part: where a MoE or hybrid target spends its time.

    python scripts/bench_target.py [--samples 1,4] [--seq-len 3072] [--experts eager,grouped_mm]
        [--compile eager,stack,layers] [--repeat 5] [--warmup 2] [--profile DIR] [hydra overrides ...]

Defaults: Qwen3-Next-80B-A3B's shape cut to 12 of its 48 layers (fits one H200 in bf16), every
layer run (drafter.target_layer_ids=[11]). Any dflash-train override applies
(target=qwen3_5_35b_a3b_random, target.arch.num_hidden_layers=8 ...).

Rows: median of --repeat forwards after --warmup (CUDA events), per experts implementation and
`--compile` variant (`eager`; `stack` and `layers`, the two `target.compile_scope`s, with the
first call's time, which includes compiling, and the graphs compiled; a `+graphs` suffix, e.g.
`layers+graphs`: the same forward replayed from a CUDA graph of its shape, target.cuda_graphs), useful TFLOP/s and MFU over
the dense bf16 peak (FLOPs as dflash/tools/target_cost.py counts them: the routed experts a
token uses, causal attention, the DeltaNet recurrence), peak memory above the weights. Then one
eager forward with CUDA events around each part (hooks: the parts' sum is a little above the plain
forward's time), per part: milliseconds, share of the forward and useful TFLOP/s.
`--experts`: transformers' experts implementations (`eager` loops over experts, `grouped_mm`
one grouped GEMM per projection, `batched_mm` gathers each token's expert weights), dflash's
`fused` Triton kernels (target.experts=fused; `fused_w8a8`, on FP8 experts with quantized activations), and `liger`, liger-kernel's fused MoE
(`LigerFusedMoEFunction`, when liger-kernel is installed: measured beside ours, not a
target.experts choice); a variant that runs out of memory is reported as such.
`--profile DIR`: each row's kernel table (torch.profiler: ops, kernels by their own time, the
device's idle gaps) in DIR/EXPERTS_COMPILE_SAMPLES.txt, for the compiled rows too, whose time
the part table cannot split (a compiled layer is one graph).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.run.inputs import script_target  # noqa: E402
from dflash.target import fused_experts  # noqa: E402
from dflash.tools.compose import compose_typed, with_defaults  # noqa: E402
from dflash.tools.kernel_profile import write_kernel_table  # noqa: E402
from dflash.tools.target_cost import PARTS, PartTimer, part_flops  # noqa: E402
from dflash.tools.timing import median_ms  # noqa: E402
from dflash.torch_runtime.compile import CompileCounter  # noqa: E402

DEFAULTS = [
    "target=qwen3_next_80b_random",
    "target.arch.num_hidden_layers=12",
    "drafter=b16",
    "drafter.mask_token_id=151669",
    "drafter.target_layer_ids=[11]",
    "gpu=single",
]
DENSE_BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in DENSE_BF16_PEAK_TFLOPS.items() if key in name), None)


def register_liger() -> None:
    """liger-kernel's fused MoE as a transformers experts implementation named `liger`."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    from transformers.integrations.moe import ExpertsInterface

    def liger_experts(self, hidden_states, top_k_index, top_k_weights):
        return LigerFusedMoEFunction.apply(
            hidden_states, self.gate_up_proj, self.down_proj, top_k_index.int(), top_k_weights
        )

    ExpertsInterface.register("liger", liger_experts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", default="1,4", help="samples per forward, comma-separated")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--experts", default="eager,grouped_mm", help="transformers experts implementations")
    parser.add_argument(
        "--compile",
        default="eager",
        help="eager, stack, layers (target.compile_scope); +graphs: replayed from CUDA graphs (target.cuda_graphs)",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--profile", help="a directory: each row's kernel table (torch.profiler), EXPERTS_COMPILE_SAMPLES.txt"
    )
    args, overrides = parser.parse_known_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_target.py times CUDA kernels: no CUDA device is visible")
    device = torch.device("cuda")
    fused_experts.register()
    if "liger" in args.experts.split(","):
        register_liger()
    defaults = DEFAULTS
    if any(o.split("=", 1)[0] == "target" for o in overrides):  # another target: none of the default's keys
        defaults = [d for d in defaults if not d.startswith(("target.", "drafter.target_layer_ids"))]
    base = with_defaults(defaults, overrides)
    target, _ = script_target(compose_typed(base), device, "bench_target")
    model, peak = target.model, peak_tflops()
    weights = torch.cuda.memory_allocated(device)
    config = target.config
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; overrides: {' '.join(base)}; "
        f"{target.feature_layers} layers ({weights / 2**30:.1f} GiB of weights), "
        f"experts {getattr(config, 'num_experts', '-')} top-{getattr(config, 'num_experts_per_tok', '-')}; "
        f"median of {args.repeat} after {args.warmup} warm-up",
        flush=True,
    )
    rows = [
        "| experts | compile | samples x tokens | time | useful TFLOP/s | MFU | peak extra memory | first call |",
        "|---|---|---|---|---|---|---|---|",
    ]
    parts = ["| experts | samples | part | ms | share | useful TFLOP/s |", "|---|---|---|---|---|---|"]

    def show() -> None:  # after each row: a later crash loses nothing
        # the part table holds eager forwards only (`--compile` without eager: none to split)
        tables = [rows] + ([parts] if len(parts) > 2 else [])
        print("\n\n".join("\n".join(table) for table in tables) + "\n", flush=True)

    for experts in [e for e in args.experts.split(",") if e]:
        if hasattr(config, "num_experts"):
            model.set_experts_implementation(experts)
        compiled_scope = None  # `layers` then `layers+graphs` share one compile
        for variant in [v for v in args.compile.split(",") if v]:
            scope, _, replayed = variant.partition("+")
            forward = target.reference_features  # the eager stack
            counter = CompileCounter(f"target ({variant})")
            if scope != "eager":
                if scope != compiled_scope:
                    torch._dynamo.reset()  # each scope compiles its own graphs
                    counters.clear()
                    target.compile_features(counter, scope=scope)
                    compiled_scope = scope
                forward = target.features
            if replayed and scope == "eager":
                raise SystemExit(
                    f"--compile {variant}: graphs replay a compiled forward (stack+graphs, layers+graphs)"
                )
            # +graphs (target.cuda_graphs): the compiled forward replayed from a graph of its shape
            sample_counts = [int(s) for s in args.samples.split(",") if s]
            # a graph for every --samples shape (one graph would leave the later shapes unreplayed)
            target.use_feature_graphs(max_shapes=len(sample_counts) if replayed else 0)
            for samples in sample_counts:
                ids = torch.randint(0, config.vocab_size - 1, (samples, args.seq_len), device=device)
                flops = part_flops(target, batch=samples, seq_len=args.seq_len)
                torch.cuda.reset_peak_memory_stats(device)
                try:
                    started = time.perf_counter()
                    forward(ids)
                    torch.cuda.synchronize(device)
                    first_s = time.perf_counter() - started  # with compilation, the compile time
                    ms = median_ms(
                        functools.partial(forward, ids), warmup=args.warmup, repeat=args.repeat, device=device
                    )
                except torch.OutOfMemoryError:
                    rows.append(
                        f"| {experts} | {variant} | {samples} x {args.seq_len} | out of memory | | | | |"
                    )
                    torch.cuda.empty_cache()
                    show()
                    continue
                extra = torch.cuda.max_memory_allocated(device) - weights
                if args.profile:  # compiled rows too: the kernels inside the graphs, by name
                    name = f"{experts}_{variant}_{samples}.txt"
                    write_kernel_table(functools.partial(forward, ids), Path(args.profile) / name)
                rate = sum(flops.values()) / ms / 1e9
                mfu = f"{100 * rate / peak:.1f}%" if peak else "-"
                breaks = sum(counters["graph_break"].values())
                graphs = f", {counter.graphs} graphs, {breaks} graph breaks" if counter.graphs else ""
                rows.append(
                    f"| {experts} | {variant} | {samples} x {args.seq_len} | {ms:.1f} ms | {rate:.0f} | {mfu} | "
                    f"{extra / 2**30:.1f} GiB | {first_s:.1f} s{graphs} |"
                )
                if variant == "eager":  # the parts of the eager forward (hooks would split compiled graphs)
                    timer = PartTimer(target)
                    forward(ids)
                    part_ms = timer.collect()
                    timer.remove()
                    for part in [p for p in PARTS if p in part_ms] + ["other"]:
                        spent = part_ms[part] if part != "other" else max(ms - sum(part_ms.values()), 0.0)
                        useful = (
                            f"{flops.get(part, 0.0) / spent / 1e9:.0f}" if part in flops and spent else "-"
                        )
                        parts.append(
                            f"| {experts} | {samples} | {part} | {spent:.2f} | {100 * spent / ms:.0f}% | {useful} |"
                        )
                show()


if __name__ == "__main__":
    main()
