"""Whether a directory already belongs to another run: the check a fresh run makes before it
writes anything there (Hydra's `.hydra/`, `train.log`, run.json), so a refusal leaves the other
run's record and config as they were."""

from __future__ import annotations

from pathlib import Path

# What a run leaves in paths.output_dir once it has trained a step.
EARLIER_RUN_FILES = ("summary.json", "metrics.jsonl")
# What a sweep leaves in hydra.sweep.dir once it has launched its first job.
EARLIER_SWEEP_FILES = ("multirun.yaml",)


def earlier_run_files(run_dir: Path) -> list[str]:
    return [
        name for name in EARLIER_RUN_FILES if (run_dir / name).is_file() and (run_dir / name).stat().st_size
    ]


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
