#!/usr/bin/env python
"""Side-by-side figures of finished runs, the first one being the reference.

    python scripts/compare_runs.py REFERENCE_RUN_DIR RUN_DIR [RUN_DIR ...]

Per run: steps, steady samples/s and tokens/s (summary.json: after the first log window, so
start-up and compilation are excluded), device time per batch of each role, peak allocated
memory over the run (the monitor's per-tick `cuda/*/peak_allocated_gb`, monitor.cuda_stats=true),
compiled drafter graphs, and the largest per-step |loss difference| against the reference over
the steps both logged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.tools.report import load_rows  # noqa: E402


def step_losses(rows: list[dict]) -> dict[int, float]:
    return {int(r["step"]): r["train/loss"] for r in rows if "train/loss" in r}


def peak_gib(rows: list[dict]) -> float:
    peaks = [
        v for r in rows for k, v in r.items() if k.startswith("cuda/") and k.endswith("/peak_allocated_gb")
    ]
    return max(peaks) * 1e9 / 2**30 if peaks else float("nan")


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    runs = [Path(arg) for arg in sys.argv[1:]]
    reference = step_losses(load_rows(runs[0]))
    print(
        "| run | steps | samples/s | tokens/s | target ms/batch | drafter ms/batch | peak allocated "
        "| compiled graphs (target / drafter) | max loss diff vs first (steps) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        summary_path = run / "summary.json"
        if not summary_path.is_file():
            print(f"| {run.name} | no summary.json (the run failed: see its log) |")
            continue
        summary = json.loads(summary_path.read_text())
        rows = load_rows(run)
        losses = step_losses(rows)
        common = sorted(set(losses) & set(reference))
        diff = max((abs(losses[s] - reference[s]) for s in common), default=float("nan"))
        print(
            f"| {run.name} | {summary['steps']} | {summary.get('perf/samples_per_s', float('nan')):.2f} "
            f"| {summary.get('perf/tokens_per_s', float('nan')):,.0f} "
            f"| {summary.get('roles/target_s_per_batch', float('nan')) * 1e3:.0f} "
            f"| {summary.get('roles/drafter_s_per_batch', float('nan')) * 1e3:.0f} "
            f"| {peak_gib(rows):.1f} GiB "
            f"| {summary.get('target_compiled_graphs', 0)} / {summary.get('drafter_compiled_graphs', 0)} "
            f"| {diff:.2e} ({len(common)}) |"
        )


if __name__ == "__main__":
    main()
