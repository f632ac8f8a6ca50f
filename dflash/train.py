"""`dflash-train` / `python -m dflash.train`: the Hydra entry point.

Imports nothing heavy at module level (no torch, no transformers): `--help`, `--cfg job`,
`--info defaults-tree` and shell completion stay fast. `train(cfg)` is a plain function
that tests call with a composed config.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from dflash.config.schema import register_configs
from dflash.errors import refuse_unquoted_home

register_configs()

# conf/ sits beside the package (editable install, as `make install` does).
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run one training job described by `cfg`; returns the final summary (floats and paths)."""
    from dflash.run.launch import build_run

    run = build_run(cfg)
    try:
        return run.execute()
    finally:
        release_devices()


def release_devices() -> None:
    """Multirun runs jobs in one process: the next job starts with free memory and fresh peaks."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)


def main() -> None:
    """`dflash-train`: the Hydra app, after the checks Hydra's own parser cannot explain."""
    refuse_unquoted_home("dflash-train", sys.argv[1:])
    hydra_main()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    # A signal ends train() with StopRequested after a checkpoint; the run-record callback
    # records the job as interrupted and exits with 128 + signal.
    summary = train(cfg)
    if "rank" in summary:  # a non-zero torchrun rank: rank 0 reports the objective
        return float("nan")
    if cfg.objective not in summary:
        raise ValueError(f"objective={cfg.objective!r} is not a summary metric; have {sorted(summary)}")
    return float(summary[cfg.objective])


if __name__ == "__main__":
    main()
