"""How a run executes and what it keeps: the devices (`gpu`), the metric sinks (`logger`),
checkpoints, the run's length and step limits, and its paths.

No torch here: see dflash/config/schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING

from dflash.config.bounds import at_least


class DeviceKind(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class GpuConfig:
    device: DeviceKind = DeviceKind.cpu
    # Number of target devices; the drafter gets `drafter` devices (null: all the rest).
    target: int = 1
    drafter: Optional[int] = 1
    # Both roles on the same device (gpu=single).
    shared: bool = False
    # Intra-op threads of torch on CPU (roles on gpu=cpu, evaluation there). 1: the tiny models
    # gain nothing from more, and a busy machine loses a lot (a 40-token prefill took 6.1 s
    # with torch's default threads and 0.35 s with one, on a shared 2-core box).
    cpu_threads: int = 1

    def __post_init__(self) -> None:
        at_least("gpu.cpu_threads", self.cpu_threads, 1)


@dataclass
class LoggerConfig:
    # Metric sinks, name -> {_target_: a sink class or factory, its keyword arguments}; each is
    # built with `context=` (the run dir, the resolved config, the step count, the start step:
    # dflash/monitor/sinks/). The logger options fill it (jsonl, console, wandb, tensorboard,
    # mlflow; a list of them, logger=[tensorboard,mlflow], fills it with each); a user adds
    # one with +logger.sinks.mine._target_=my_module.MySink, drops one with ~logger.sinks.NAME.
    sinks: dict[str, Any] = field(default_factory=dict)
    every_steps: int = 10

    def __post_init__(self) -> None:
        at_least("logger.every_steps", self.every_steps, 1)


@dataclass
class CheckpointConfig:
    every_steps: int = 1000
    keep_last: int = 3

    def __post_init__(self) -> None:
        if self.every_steps < 1 or self.keep_last < 1:
            raise ValueError("checkpoint.every_steps and checkpoint.keep_last must be >= 1")


@dataclass
class DebugConfig:
    name: str = "none"
    # Stop after this many optimizer steps (the LR schedule still spans the whole run).
    max_steps: Optional[int] = None
    detect_anomaly: bool = False

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"debug.max_steps must be >= 1 (or null: no limit), got {self.max_steps}")


@dataclass
class PathsConfig:
    output_dir: str = MISSING
    cache_dir: str = MISSING


@dataclass
class TrainConfig:
    epochs: int = 6
    # Overrides epochs: total optimizer steps (the LR schedule spans exactly these).
    total_steps: Optional[int] = None

    def __post_init__(self) -> None:
        at_least("train.epochs", self.epochs, 1)
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"train.total_steps must be >= 1 or null, got {self.total_steps}")
