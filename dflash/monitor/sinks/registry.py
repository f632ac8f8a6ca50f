"""The sinks a run is built with (`logger.sinks`), and what each needs checked before any
weights load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dflash.config.components import build, check_buildable
from dflash.monitor.sinks.base import MetricSink, OptionalLibrary, SinkContext
from dflash.monitor.sinks.console import ConsoleSink
from dflash.monitor.sinks.mlflow import MlflowSink, mlflow_sink
from dflash.monitor.sinks.mlflow_store import MLFLOW, check_mlflow_destination
from dflash.monitor.sinks.progress import ProgressSink
from dflash.monitor.sinks.tensorboard import TENSORBOARD, TensorBoardSink, check_tensorboard_destination
from dflash.monitor.sinks.wandb import WandbSink, check_wandb_destination, wandb_sink

# The optional library of each sink that needs one: checked before any weights load.
SINK_LIBRARIES: dict[Any, OptionalLibrary] = {
    TensorBoardSink: TENSORBOARD,
    MlflowSink: MLFLOW,
    mlflow_sink: MLFLOW,
}

# Where each sink that writes outside metrics.jsonl writes (a directory, a store, a server),
# checked before any weights load: called with the entry's key (logger.sinks.NAME), the run dir,
# the checkpoint a resumed run continues and the entry's own settings.
SINK_DESTINATIONS: dict[Any, Callable[..., None]] = {
    TensorBoardSink: check_tensorboard_destination,
    MlflowSink: check_mlflow_destination,
    mlflow_sink: check_mlflow_destination,
    WandbSink: check_wandb_destination,
    wandb_sink: check_wandb_destination,
}


def check_sink_destinations(nodes: dict[str, Any], *, run_dir: Path, resume_dir: Path | None) -> None:
    """Each sink's destination takes this run's writes (SINK_DESTINATIONS), refused in one line
    naming the entry's key otherwise."""
    for name, node in nodes.items():
        key = f"logger.sinks.{name}"
        check = SINK_DESTINATIONS.get(check_buildable(node, key, runtime=("context",)))
        if check is not None:
            settings = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
            settings.pop("_target_", None)
            check(key=key, run_dir=run_dir, resume_dir=resume_dir, **settings)


def build_sinks(nodes: dict[str, Any], context: SinkContext) -> list[MetricSink]:
    """`logger.sinks`, each built with `context` (a ConsoleSink draws the progress bar itself:
    a plain ProgressSink beside one is left out)."""
    classes = {
        name: check_buildable(node, f"logger.sinks.{name}", runtime=("context",))
        for name, node in nodes.items()
    }
    console = any(isinstance(c, type) and issubclass(c, ConsoleSink) for c in classes.values())
    return [
        build(node, f"logger.sinks.{name}", context=context)
        for name, node in nodes.items()
        if not (console and classes[name] is ProgressSink)
    ]
