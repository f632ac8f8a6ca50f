#!/usr/bin/env python
"""Training throughput of two variants of the same config, measured side by side in one run.

    python scripts/bench_pipeline.py [--compare pipeline|monitor] [--steps N] [hydra overrides ...]

--compare pipeline (default): pipeline=sync vs pipeline=async.
--compare monitor: pipeline=async with the monitor ticking every 0.5 s with NVML and allocator
    telemetry and a metric window every step, vs a quiet monitor (one window at the end, no
    telemetry): the cost of observability.

Each variant first runs the same config untimed (CUDA context, kernels, allocator), then trains
N steps timed from the first step to the last (async target warm-up excluded). Tokens/s and
samples/s come from the pipeline's own counters; the table ends with the ratio of the two.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.build import build_run  # noqa: E402
from dflash.tools.compose import compose_config  # noqa: E402

VARIANTS = {
    "pipeline": {
        "sync": ["pipeline=sync"],
        "async": ["pipeline=async"],
    },
    "monitor": {
        "monitor quiet": [
            "pipeline=async",
            "monitor.interval_s=1e9",
            "monitor.telemetry=false",
            "monitor.cuda_stats=false",
            "logger.every_steps=1000000",
        ],
        "monitor 0.5s": [
            "pipeline=async",
            "monitor.interval_s=0.5",
            "monitor.telemetry=true",
            "monitor.cuda_stats=true",
            "logger.every_steps=1",
        ],
    },
}


def measure(overrides: list[str], steps: int, out: Path) -> dict[str, float]:
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
        started = time.perf_counter()
        trainer.run()
        elapsed = time.perf_counter() - started
    finally:
        trainer.monitor.close(True)
    counters = trainer.pipeline_stats()
    tokens = sum(v for k, v in counters.items() if k.startswith("count/drafter") and k.endswith("_tokens"))
    samples = sum(v for k, v in counters.items() if k.startswith("count/drafter") and k.endswith("_samples"))
    loss = trainer.monitor.history[-1]["train/loss"] if trainer.monitor.history else float("nan")
    return {
        "tokens_per_s": tokens / elapsed,
        "samples_per_s": samples / elapsed,
        "seconds": elapsed,
        "loss": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", choices=sorted(VARIANTS), default="pipeline")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=30, help="untimed run before each variant")
    args, overrides = parser.parse_known_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, variant in VARIANTS[args.compare].items():
            measure([*overrides, *variant], args.warmup_steps, Path(tmp) / f"warm-{len(results)}")
            results[name] = measure([*overrides, *variant], args.steps, Path(tmp) / f"run-{len(results)}")
    print(f"\noverrides: {' '.join(overrides) or '(defaults)'}; {args.steps} timed steps")
    print("| variant | tokens/s | samples/s | seconds | final loss |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['samples_per_s']:,.1f} | {r['seconds']:.1f} | {r['loss']:.4f} |"
        )
    (a, ra), (b, rb) = results.items()
    print(
        f"| {b} / {a} | {rb['tokens_per_s'] / ra['tokens_per_s']:.3f}x | "
        f"{rb['samples_per_s'] / ra['samples_per_s']:.3f}x | | |"
    )


if __name__ == "__main__":
    main()
