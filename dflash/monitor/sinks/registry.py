"""The sinks a run is built with (`logger.sinks`), and what each needs checked before any
weights load."""

from __future__ import annotations

from typing import Any

from dflash.config.components import build, check_buildable
from dflash.monitor.sinks.base import MetricSink, OptionalLibrary, SinkContext
from dflash.monitor.sinks.console import ConsoleSink
from dflash.monitor.sinks.mlflow import MLFLOW, MlflowSink, mlflow_sink
from dflash.monitor.sinks.progress import ProgressSink
from dflash.monitor.sinks.tensorboard import TENSORBOARD, TensorBoardSink

# The optional library of each sink that needs one: checked before any weights load.
SINK_LIBRARIES: dict[Any, OptionalLibrary] = {
    TensorBoardSink: TENSORBOARD,
    MlflowSink: MLFLOW,
    mlflow_sink: MLFLOW,
}


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
