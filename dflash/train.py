"""`dflash train` (alias `dflash-train`, or `python -m dflash.train`): the Hydra entry point.

Imports nothing heavy at module level (no torch, no transformers): `--help`, `--cfg job`,
`--info defaults-tree` and shell completion stay fast. `train(cfg)` is a plain function
that tests call with a composed config.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from dflash.config.plugins import load_plugins
from dflash.config.schema import register_configs
from dflash.target.model_dirs import refuse_missing_target_dirs
from dflash.tools.hydra_app import hydra_command

register_configs()


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run one training job described by `cfg`; returns the final summary (floats and paths)."""
    # A sweep launcher's job may run in a process of its own, where the command's start loaded
    # no plug-in (one that fails here is a PluginError: one line, exit 2, as a config mistake).
    load_plugins()
    # A mistyped local target path is refused now, not after the model code has loaded.
    refuse_missing_target_dirs(cfg)
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


COMMON_OVERRIDES = (
    "gpu=single target=hf target.path=/models/MyModel   a target of your own, on one GPU",
    "data=conversations data.files=[chat.jsonl]         your conversations (docs/real-data.md)",
    "experiment=qwen3_8b                                a whole recipe (the experiment group)",
    "train.epochs=6 logger.every_steps=10               how long (or train.total_steps=N), how often it logs",
    "drafter=b16 drafter.mask_token_id=151669           the paper's drafter; its mask: an unused token of the target",
    "optimizer.lr=6e-4 loss.gamma=7                     the learning rate and the objective",
    "resume=outputs/RUN/checkpoints/last                continue a run where it stopped",
    "logger=wandb                                       metrics to W&B too (logger=tensorboard, logger=mlflow)",
    "debug=fast                                         a few steps through every stage",
)


def train_job(cfg: DictConfig) -> float:
    """What `dflash train` runs on the composed config: the objective a sweep's search reads."""
    # A signal ends train() with StopRequested after a checkpoint; the run-record callback
    # records the job as interrupted and exits with 128 + signal.
    summary = train(cfg)
    if "rank" in summary:  # a non-zero torchrun rank: rank 0 reports the objective
        return float("nan")
    if cfg.objective not in summary:
        raise ValueError(f"objective={cfg.objective!r} is not a summary metric; have {sorted(summary)}")
    return float(summary[cfg.objective])


main = hydra_command(
    train_job,
    tool="dflash train",
    summary="Train a DFlash drafter against a frozen target. With no overrides: the tiny CPU "
    "drafter end to end\n(data, training, evaluation, summary), about a minute.",
    config_name="config",
    overrides=COMMON_OVERRIDES,
)


if __name__ == "__main__":
    main()
