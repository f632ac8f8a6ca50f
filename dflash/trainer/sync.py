"""The reference trainer (`pipeline=sync`): target forward, then the drafter step, in one thread.

It is the correctness oracle for the asynchronous pipeline and its performance baseline.
Host reads of device values happen only at log steps (`StepMetrics.snapshot`).
"""

from __future__ import annotations

import logging
import time

from dflash.data.collate import collate
from dflash.data.dataset import TokenDataset
from dflash.data.schedule import BatchPlanner
from dflash.logging.sinks import MetricSink
from dflash.trainer import state
from dflash.trainer.metrics_log import MetricsLog
from dflash.trainer.signals import StopRequested, stop_on_signals
from dflash.trainer.state import CheckpointSettings, DataPosition
from dflash.trainer.step import DrafterStep

log = logging.getLogger(__name__)


class SyncTrainer:
    def __init__(
        self,
        step_fn: DrafterStep,
        dataset: TokenDataset,
        planner: BatchPlanner,
        sinks: list[MetricSink],
        stop_after: int,
        log_every: int,
        checkpoints: CheckpointSettings,
    ):
        self.step_fn = step_fn
        self.drafter = step_fn.drafter
        self.target = step_fn.target
        self.dataset, self.planner = dataset, planner
        self.stop_after, self.log_every, self.checkpoints = stop_after, log_every, checkpoints
        self.metrics_log = MetricsLog(sinks)
        self.position = DataPosition()

    def restore(self, directory) -> None:
        self.position = state.restore(directory, [self.step_fn])

    def save(self):
        return state.save(self.checkpoints, self.step_fn, self.position)

    def run(self) -> None:
        window_start = time.perf_counter()
        with stop_on_signals() as stop:
            while self.position.step < self.stop_after:
                if stop.is_set():
                    log.warning("stop requested at step %d: writing a checkpoint", self.position.step)
                    self.save()
                    raise StopRequested(stop.signum)
                seq = self.position.next_seq
                batch = collate(self.dataset, self.planner.at(seq))
                features = self.target.features(batch.input_ids.to(self.target.device))
                self.step_fn(batch, features, self.position.step)
                self.position = DataPosition(next_seq=seq + 1, step=self.position.step + 1)
                step = self.position.step
                if step % self.log_every == 0 or step == self.stop_after:
                    snapshot = self.step_fn.metrics.snapshot_and_reset(step)
                    self.metrics_log.log_window(
                        step, [snapshot], time.perf_counter() - window_start, self.step_fn.lr
                    )
                    window_start = time.perf_counter()
                if step % self.checkpoints.every_steps == 0 and step != self.stop_after:
                    self.save()
        self.save()
