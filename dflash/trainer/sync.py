"""The reference trainer (`pipeline=sync`): target forward, then the drafter step, in one thread.

It is the correctness oracle for the asynchronous pipeline and its performance baseline.
Host reads of device values happen only at log steps (`StepMetrics.snapshot`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.checkpoint import load_trainer_state, save_checkpoint
from dflash.data.collate import collate
from dflash.data.dataset import TokenDataset
from dflash.data.schedule import BatchPlanner
from dflash.logging.sinks import MetricSink
from dflash.trainer.step import DrafterStep

log = logging.getLogger(__name__)


@dataclass
class DataPosition:
    """Where the next batch comes from: batch `index` of `epoch`, after `step` optimizer steps."""

    epoch: int = 0
    index: int = 0
    step: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "step": self.step}


@dataclass
class LoopSettings:
    total_steps: int  # the LR schedule spans these
    stop_after: int  # debug.max_steps, else total_steps
    log_every: int
    checkpoint_every: int
    keep_last: int
    checkpoint_dir: Path
    run_config_yaml: str


class SyncTrainer:
    def __init__(
        self,
        step_fn: DrafterStep,
        dataset: TokenDataset,
        planner: BatchPlanner,
        sinks: list[MetricSink],
        settings: LoopSettings,
    ):
        self.step_fn = step_fn
        self.target = step_fn.target
        self.dataset, self.planner, self.sinks, self.settings = dataset, planner, sinks, settings
        self.position = DataPosition()
        self.history: list[dict[str, float]] = []

    # -- checkpoints -------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        state = {
            "optimizer": self.step_fn.optimizer.state_dict(),
            "lr_scheduler": self.step_fn.lr_scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "position": self.position.as_dict(),
        }
        if torch.cuda.is_available():
            state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def save(self) -> Path:
        path = save_checkpoint(
            self.settings.checkpoint_dir,
            self.position.step,
            self.step_fn.drafter,
            self.trainer_state(),
            self.settings.run_config_yaml,
            self.settings.keep_last,
        )
        log.info("checkpoint: %s", path)
        return path

    def restore(self, directory: Path) -> None:
        """Trainer state from `directory` (the drafter weights are loaded by the builder)."""
        state = load_trainer_state(directory)
        self.step_fn.optimizer.load_state_dict(state["optimizer"])
        self.step_fn.lr_scheduler.load_state_dict(state["lr_scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.position = DataPosition(**state["position"])
        log.info("resumed from %s at %s", directory, self.position)

    # -- loop --------------------------------------------------------------------------------
    def _log(self, window_start: float) -> None:
        metrics = self.step_fn.metrics.snapshot()
        elapsed = max(time.perf_counter() - window_start, 1e-9)
        steps = self.step_fn.metrics.steps
        metrics.update(
            {
                "train/lr": self.step_fn.lr,
                "train/epoch": float(self.position.epoch),
                "perf/tokens_per_s": self.step_fn.metrics.real_tokens / elapsed,
                "perf/anchors_per_s": self.step_fn.metrics.anchors / elapsed,
                "perf/step_time_s": elapsed / max(1, steps),
            }
        )
        self.step_fn.metrics.reset()
        self.history.append({"step": float(self.position.step), **metrics})
        for sink in self.sinks:
            sink.log(metrics, self.position.step)

    def run(self) -> None:
        settings = self.settings
        window_start = time.perf_counter()
        try:
            while self.position.step < settings.stop_after:
                plan = self.planner.epoch(self.position.epoch)
                if self.position.index >= len(plan):
                    self.position = DataPosition(self.position.epoch + 1, 0, self.position.step)
                    continue
                batch = collate(self.dataset, plan[self.position.index])
                features = self.target.features(
                    batch.input_ids.to(self.target.device), batch.attention_mask.to(self.target.device)
                )
                self.step_fn(batch, features, self.position.step)
                self.position = DataPosition(
                    self.position.epoch, self.position.index + 1, self.position.step + 1
                )
                step = self.position.step
                if step % settings.log_every == 0 or step == settings.stop_after:
                    self._log(window_start)
                    window_start = time.perf_counter()
                if step % settings.checkpoint_every == 0 and step != settings.stop_after:
                    self.save()
        except KeyboardInterrupt:
            log.warning("interrupted at step %d: writing a checkpoint before exiting", self.position.step)
            self.save()
            raise
        self.save()
