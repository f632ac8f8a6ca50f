"""Whether a directory already belongs to another run: the check a fresh run makes before it
writes anything there (Hydra's `.hydra/`, `train.log`, run.json), so a refusal leaves the other
run's record and config as they were."""

from __future__ import annotations

import json
from pathlib import Path

# What a run leaves in paths.output_dir once it has trained a step (metrics.jsonl from its
# start: the monitor logs at step 0 while the first step compiles, so it counts once it holds a
# row of a trained step).
EARLIER_RUN_FILES = ("summary.json", "metrics.jsonl")
# Where a fresh run moves the step-0 rows of an attempt stopped before its first step.
UNTRAINED_METRICS = "metrics.before-first-step.jsonl"
# What a sweep leaves in hydra.sweep.dir once it has launched its first job.
EARLIER_SWEEP_FILES = ("multirun.yaml",)


def earlier_run_files(run_dir: Path) -> list[str]:
    found = [
        name for name in EARLIER_RUN_FILES if (run_dir / name).is_file() and (run_dir / name).stat().st_size
    ]
    if found == ["metrics.jsonl"] and not _records_a_trained_step(run_dir / "metrics.jsonl"):
        return []  # an attempt stopped before its first step: nothing to continue, nothing to lose
    return found


def set_aside_untrained_attempt(run_dir: Path) -> Path | None:
    """Before a fresh run writes into `run_dir`: the metrics of an earlier attempt that never
    finished a step (stopped while its first step compiled, say) move to UNTRAINED_METRICS, so
    the new run's file starts at its own first row and the old rows stay readable."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or earlier_run_files(run_dir):
        return None
    target = run_dir / UNTRAINED_METRICS
    with target.open("a") as out:
        out.write(metrics.read_text())
    metrics.unlink()
    return target


def _records_a_trained_step(metrics: Path) -> bool:
    with metrics.open() as rows:
        for line in rows:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a row cut short by a kill
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] >= 1:
                return True
    return False


def refuse_earlier_run(run_dir: Path, *, resume: str | None = None, key: str = "paths.output_dir") -> None:
    """A fresh run into a directory that holds another run's results would append its rows to
    that run's metrics (the same steps twice) and replace its summary: refused, saying how to
    continue that run or start elsewhere. A resume continues the run whose directory holds its
    checkpoint; resuming one run into another run's directory is refused the same way."""
    found = earlier_run_files(run_dir)
    if not found or (resume and _inside(Path(resume), run_dir)):
        return
    last = run_dir / "checkpoints" / "last"
    continues = f"resume={last}" if last.exists() else "resume=<one of its checkpoints>"
    raise ValueError(
        f"{key}={run_dir} holds an earlier run ({', '.join(found)}): {continues} continues "
        "that run; to start a new one, give it another directory (paths.output_dir or hydra.run.dir)"
    )


def refuse_earlier_sweep(sweep_dir: Path) -> None:
    found = [name for name in EARLIER_SWEEP_FILES if (sweep_dir / name).is_file()]
    if found:
        raise ValueError(
            f"hydra.sweep.dir={sweep_dir} holds an earlier sweep ({', '.join(found)}); "
            "give this sweep its own hydra.sweep.dir"
        )


def _inside(path: Path, directory: Path) -> bool:
    try:
        return path.resolve().is_relative_to(directory.resolve())
    except OSError:
        return False
