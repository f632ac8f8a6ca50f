#!/usr/bin/env python
"""Throughput of pipeline=sync vs pipeline=async on the same config, side by side in one run.

    python scripts/bench_pipeline.py [--steps N] [--warmup-steps W] [hydra overrides ...]
    python scripts/bench_pipeline.py gpu=single target.arch.hidden_size=1024 ...

Each pipeline trains W steps (not timed: kernel autotuning, allocator growth), then N timed
steps; the table reports tokens/s and samples/s of the timed window and async/sync ratios.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.global_hydra import GlobalHydra  # noqa: E402

from dflash.build import build_run  # noqa: E402
from dflash.config.schema import register_configs  # noqa: E402

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def measure(pipeline: str, overrides: list[str], steps: int, warmup: int, out: Path) -> dict[str, float]:
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                *overrides,
                f"pipeline={pipeline}",
                "monitor.interval_s=0",
                f"train.total_steps={warmup + steps}",
                f"logger.every_steps={steps if warmup == 0 else warmup}",
                f"checkpoint.every_steps={warmup + steps}",
                f"paths.output_dir={out / pipeline}",
            ],
        )
    if warmup and steps % warmup:
        raise SystemExit("--steps must be a multiple of --warmup-steps (windows are log_every long)")
    run = build_run(cfg)
    try:
        run.trainer.run()
    finally:
        run.trainer.monitor.close(True)
    timed = run.trainer.monitor.history[1:] if warmup else run.trainer.monitor.history
    tokens_per_s = sum(h["perf/tokens_per_s"] for h in timed) / len(timed)
    samples_per_s = sum(h["perf/samples_per_s"] for h in timed) / len(timed)
    windows = [round(h["train/loss"], 4) for h in run.trainer.monitor.history]
    return {
        "tokens_per_s": tokens_per_s,
        "samples_per_s": samples_per_s,
        "loss": timed[-1]["train/loss"],
        "windows": windows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=50)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            p: measure(p, overrides, args.steps, args.warmup_steps, Path(tmp)) for p in ("sync", "async")
        }
    print(
        f"\noverrides: {' '.join(overrides) or '(defaults)'}; {args.steps} timed steps after {args.warmup_steps}"
    )
    print("| pipeline | tokens/s | samples/s | final loss |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {r['samples_per_s']:,.1f} | {r['loss']:.4f} |")
    ratio_tokens = results["async"]["tokens_per_s"] / results["sync"]["tokens_per_s"]
    ratio_samples = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"| async/sync | {ratio_tokens:.2f}x | {ratio_samples:.2f}x | |")
    for name, r in results.items():
        print(f"{name} loss per window: {r['windows']}")


if __name__ == "__main__":
    main()
