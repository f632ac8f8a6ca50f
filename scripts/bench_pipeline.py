#!/usr/bin/env python
"""Training throughput of variants of the same config, measured side by side in one run.

    python scripts/bench_pipeline.py [--compare pipeline|monitor|layout] [--steps N] [hydra overrides ...]

--compare pipeline (default): pipeline=sync vs pipeline=async.
--compare monitor: pipeline=async with the monitor ticking every 0.5 s with NVML and allocator
    telemetry and a metric window every step, vs a quiet monitor (one window at the end, no
    telemetry): the cost of observability.
--compare layout (2 GPUs): pipeline=async with both roles on one GPU (gpu=single), one target
    GPU + one drafter GPU (gpu=split gpu.target=1), and two torchrun processes with both roles on
    a GPU each (gpu=single under `torchrun --nproc-per-node=2`, gradients summed over NCCL).

Each variant first runs the same config untimed (CUDA context, kernels, allocator), then trains
N steps timed from the first step to the last (async target warm-up and the final checkpoint
excluded). Tokens/s and
samples/s come from the pipeline's own counters (summed over processes); each role's busy share
is its device time over the wall time. The table ends with each variant's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.pipeline.counters import drafter_totals  # noqa: E402
from dflash.run.launch import build_run  # noqa: E402
from dflash.tools.compose import compose_config  # noqa: E402


@dataclass(frozen=True)
class Variant:
    overrides: list[str]
    processes: int = 1  # > 1: launched under torchrun --nproc-per-node=processes


VARIANTS = {
    "pipeline": {
        "sync": Variant(["pipeline=sync"]),
        "async": Variant(["pipeline=async"]),
    },
    "monitor": {
        "monitor quiet": Variant(
            [
                "pipeline=async",
                "monitor.interval_s=1e9",
                "monitor.telemetry=false",
                "monitor.cuda_stats=false",
                "logger.every_steps=1000000",
            ]
        ),
        "monitor 0.5s": Variant(
            [
                "pipeline=async",
                "monitor.interval_s=0.5",
                "monitor.telemetry=true",
                "monitor.cuda_stats=true",
                "logger.every_steps=1",
            ]
        ),
    },
    "layout": {
        "1 GPU, both roles": Variant(["pipeline=async", "gpu=single"]),
        "split: 1 target GPU + 1 drafter GPU": Variant(["pipeline=async", "gpu=split", "gpu.target=1"]),
        "torchrun 2 x (1 GPU, both roles)": Variant(["pipeline=async", "gpu=single"], processes=2),
    },
}


def measure(overrides: list[str], steps: int, out: Path) -> dict[str, float]:
    """Train `steps` steps in this process; its own counters and timings."""
    cfg = compose_config(
        [
            *overrides,
            f"train.total_steps={steps}",
            f"checkpoint.every_steps={steps}",
            f"paths.output_dir={out}",
        ]
    )
    run = build_run(cfg)
    trainer = run.trainer
    try:
        if hasattr(trainer, "prepare"):
            trainer.prepare()
        trainer.run()
    finally:
        trainer.monitor.close(True)
        run.process_group.close()
    counters = trainer.pipeline_stats()
    roles = trainer.role_summary()
    return {
        "tokens": drafter_totals(counters, "tokens"),
        "samples": drafter_totals(counters, "samples"),
        # The trainer's own clock: first step to last, without the final checkpoint (seconds
        # for a 1B-parameter drafter and its AdamW state) that an outer timer would include.
        "seconds": trainer.train_wall_s,
        "loss": trainer.monitor.history[-1]["train/loss"] if trainer.monitor.history else float("nan"),
        "target_busy": roles.get("roles/target_busy_frac", float("nan")),
        "drafter_busy": roles.get("roles/drafter_busy_frac", float("nan")),
        "data_wait": roles.get("roles/data_wait_frac", float("nan")),
        "target_ms": roles.get("roles/target_s_per_batch", float("nan")) * 1e3,
        "drafter_ms": roles.get("roles/drafter_s_per_batch", float("nan")) * 1e3,
    }


def measure_torchrun(variant: Variant, args: argparse.Namespace, overrides: list[str], out: Path) -> dict:
    """Launch this script under torchrun; every rank writes its figures, summed here."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={variant.processes}",
        __file__,
        "--rank-results",
        str(out),
        "--steps",
        str(args.steps),
        "--warmup-steps",
        str(args.warmup_steps),
        *overrides,
        *variant.overrides,
    ]
    subprocess.run(command, check=True)
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert len(ranks) == variant.processes, f"expected {variant.processes} rank results in {out}"
    summed = {key: sum(r[key] for r in ranks) for key in ("tokens", "samples")}
    averaged = {key: sum(r[key] for r in ranks) / len(ranks) for key in ranks[0] if key not in summed}
    return {**averaged, **summed, "seconds": max(r["seconds"] for r in ranks), "loss": ranks[0]["loss"]}


def rank_main(args: argparse.Namespace, overrides: list[str]) -> None:
    """One torchrun rank: warm up, measure, write rank<r>.json (the timed run only)."""
    import torch
    import torch.distributed as dist

    # Joined here, once, so the warm-up and the timed run share one process group (the
    # trainer leaves a group it did not create in place).
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    runs = args.rank_results / "runs"  # the same run dir on every rank: rank 0 writes it
    measure(overrides, args.warmup_steps, runs / "warm")
    result = measure(overrides, args.steps, runs / "timed")
    (args.rank_results / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", choices=sorted(VARIANTS), default="pipeline")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=30, help="untimed run before each variant")
    parser.add_argument("--rank-results", type=Path, help=argparse.SUPPRESS)  # set for torchrun ranks
    args, overrides = parser.parse_known_args()
    if args.rank_results is not None:
        rank_main(args, overrides)
        return
    print(f"overrides: {' '.join(overrides) or '(defaults)'}; {args.steps} timed steps", flush=True)
    rows = [
        "| variant | tokens/s | samples/s | seconds | target busy | drafter busy | drafters waiting "
        "| target ms/batch | drafter ms/batch | final loss | vs first |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first_rate = None
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, variant) in enumerate(VARIANTS[args.compare].items()):
            out = Path(tmp) / f"variant-{index}"
            if variant.processes > 1:
                r = measure_torchrun(variant, args, overrides, out)
            else:
                measure([*overrides, *variant.overrides], args.warmup_steps, out / "warm")
                r = measure([*overrides, *variant.overrides], args.steps, out / "timed")
                release_memory()  # the next variant may be other processes on these GPUs
            rate = r["tokens"] / r["seconds"]
            first_rate = first_rate or rate
            rows.append(
                f"| {name} | {rate:,.0f} | {r['samples'] / r['seconds']:,.1f} | {r['seconds']:.1f} "
                f"| {r['target_busy']:.0%} | {r['drafter_busy']:.0%} | {r['data_wait']:.0%} "
                f"| {r['target_ms']:.1f} | {r['drafter_ms']:.1f} | {r['loss']:.4f} | {rate / first_rate:.2f}x |"
            )
            print("\n".join(rows), flush=True)  # the table so far: a later variant's crash loses nothing


def release_memory() -> None:
    import gc

    from dflash.train import release_devices

    gc.collect()
    release_devices()


if __name__ == "__main__":
    main()
