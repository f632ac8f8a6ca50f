"""The sinks a run is built with (`logger.sinks`), and what each needs checked before any
weights load."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dflash.config.components import build, check_buildable
from dflash.monitor.sinks.base import MetricSink, OptionalLibrary, SinkContext, SinkDestination
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
# checked before any weights load, given the entry as a SinkDestination.
SINK_DESTINATIONS: dict[Any, Callable[[SinkDestination], None]] = {
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
        built_by = check_buildable(node, key, runtime=("context",))
        check = SINK_DESTINATIONS.get(built_by)
        if check is not None:
            settings = sink_settings(built_by, node)
            check(SinkDestination(key=key, run_dir=run_dir, resume_dir=resume_dir, settings=settings))


def sink_settings(built_by: Callable[..., Any], node: Any) -> dict[str, Any]:
    """What the sink will be built with: the entry's keys over the defaults of its signature, so
    a check looks where the sink will write whichever keys the entry leaves out."""
    given = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    given.pop("_target_", None)
    parameters = inspect.signature(built_by).parameters.values()
    return {**{p.name: p.default for p in parameters if p.default is not p.empty}, **given}


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
