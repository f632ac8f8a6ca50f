"""Metric sinks (config group `logger`, `logger.sinks`): metrics.jsonl, console lines, W&B,
TensorBoard event files, MLflow; one module per sink, their shared base in `base.py`, the
registry the run builds them from in `registry.py`.

A sink receives one flat dict of floats per log step. `close(ok)` always runs, also when the job
fails, so a W&B or MLflow run is always finished (marked failed when the job failed). Optional
hooks: `on_checkpoint(step, path)` after each checkpoint, `log_summary(summary)` with the run
summary (what summary.json holds) of a run that got that far.

Each entry of `logger.sinks` names a class or factory (`_target_`) built with the run's
`context=` (SinkContext) and the entry's other keys; a user's sink is one class with `log` and
`close` (docs/extending.md): +logger.sinks.mine._target_=my_module.MySink.
"""

from dflash.monitor.sinks.background import BackgroundSink
from dflash.monitor.sinks.base import (
    MetricSink,
    OptionalLibrary,
    SinkContext,
    SinkDestination,
    hydra_choice,
    sweep_naming,
)
from dflash.monitor.sinks.console import ConsoleSink
from dflash.monitor.sinks.jsonl import JsonlSink
from dflash.monitor.sinks.mlflow import (
    MLFLOW_PARAM_CHARS,
    MLFLOW_TAG_CHARS,
    MlflowSink,
    config_params,
    mlflow_artifact_location,
    mlflow_name,
    mlflow_sink,
    mlflow_value,
)
from dflash.monitor.sinks.mlflow_store import (
    MLFLOW,
    MLFLOW_RUN_FILE,
    default_mlflow_store,
    is_local_mlflow_store,
    resumed_mlflow_run,
)
from dflash.monitor.sinks.progress import ProgressSink
from dflash.monitor.sinks.registry import (
    SINK_DESTINATIONS,
    SINK_LIBRARIES,
    build_sinks,
    check_sink_destinations,
)
from dflash.monitor.sinks.tensorboard import TENSORBOARD, TensorBoardSink
from dflash.monitor.sinks.wandb import (
    EVAL_STEP,
    WANDB_RUN_FILE,
    WandbSink,
    resumed_wandb_run,
    wandb_mode,
    wandb_sink,
)

# The names `logger.sinks.*._target_` and user code import from `dflash.monitor.sinks`.
__all__ = [
    "EVAL_STEP",
    "MLFLOW",
    "MLFLOW_PARAM_CHARS",
    "MLFLOW_RUN_FILE",
    "MLFLOW_TAG_CHARS",
    "SINK_DESTINATIONS",
    "SINK_LIBRARIES",
    "TENSORBOARD",
    "WANDB_RUN_FILE",
    "BackgroundSink",
    "ConsoleSink",
    "JsonlSink",
    "MetricSink",
    "MlflowSink",
    "OptionalLibrary",
    "ProgressSink",
    "SinkContext",
    "SinkDestination",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "check_sink_destinations",
    "config_params",
    "default_mlflow_store",
    "hydra_choice",
    "is_local_mlflow_store",
    "mlflow_artifact_location",
    "mlflow_name",
    "mlflow_sink",
    "mlflow_value",
    "resumed_mlflow_run",
    "resumed_wandb_run",
    "sweep_naming",
    "wandb_mode",
    "wandb_sink",
]
