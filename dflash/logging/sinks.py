"""Metric sinks (config group `logger`): metrics.jsonl, console lines, W&B.

A sink receives one flat dict of floats per log step. `close(ok)` always runs, also when the job
fails, so a W&B run is always finished (with a failing exit code when the job failed).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import Any, Protocol

from dflash.config.schema import LoggerConfig, SinkKind, WandbConfig

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, ok: bool) -> None: ...


class JsonlSink:
    """<run_dir>/metrics.jsonl: one JSON object per log step, flushed so readers see it at once."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # NaN/inf are not JSON: written as null so every line stays parseable by later tools.
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self, ok: bool) -> None:
        self._file.close()


class ConsoleSink:
    KEYS = ("train/loss", "train/acc", "train/tau_sim", "train/grad_norm", "train/lr", "perf/tokens_per_s")

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"{k.split('/')[-1]}={metrics[k]:.4g}" for k in self.KEYS if k in metrics]
        log.info("step %d  %s", step, "  ".join(parts))

    def close(self, ok: bool) -> None:
        pass


def wandb_mode(cfg: WandbConfig) -> str:
    """Explicit config wins, then WANDB_MODE; without an API key there is no network use: offline."""
    if cfg.mode:
        return cfg.mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class WandbSink:
    def __init__(self, cfg: WandbConfig, run_dir: Path, resolved_config: dict[str, Any]):
        import wandb

        self.timeout_s = cfg.finish_timeout_s
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            name=cfg.name,
            tags=list(cfg.tags),
            config=resolved_config,
            dir=str(run_dir),
            mode=wandb_mode(cfg),
            reinit="finish_previous",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, ok: bool) -> None:
        # finish() uploads what is left; a stalled network must not hang the job forever.
        finisher = threading.Thread(target=self.run.finish, kwargs={"exit_code": 0 if ok else 1}, daemon=True)
        finisher.start()
        finisher.join(self.timeout_s)
        if finisher.is_alive():
            log.warning("wandb: finish() did not return within %.0f s; continuing", self.timeout_s)


def build_sinks(cfg: LoggerConfig, run_dir: Path, resolved_config: dict[str, Any]) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    for kind in dict.fromkeys(SinkKind(k) for k in cfg.sinks):
        if kind is SinkKind.jsonl:
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        elif kind is SinkKind.console:
            sinks.append(ConsoleSink())
        elif kind is SinkKind.wandb:
            sinks.append(WandbSink(cfg.wandb, run_dir, resolved_config))
    return sinks
