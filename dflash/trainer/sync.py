"""The reference trainer (`pipeline=sync`): target forward, then the drafter step, in one thread.

It is the correctness oracle for the asynchronous pipeline and its performance baseline. It
exposes the same probe to the monitor (windows, batch stats, counters); the monitor ticks
between steps, on this same thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from dflash.cadence import Cadence
from dflash.data.collate import collate
from dflash.data.dataset import TokenDataset
from dflash.data.schedule import BatchPlanner
from dflash.distributed import ProcessGroupInfo
from dflash.models.target import FrozenTarget
from dflash.monitor.monitor import Monitor
from dflash.pipeline.counters import DeviceSpan, WorkCounters
from dflash.pipeline.prefetch import BatchStats
from dflash.pipeline.replicas import check_replicas_identical
from dflash.pipeline.roles import role_summary
from dflash.step import DrafterStep
from dflash.step_metrics import MetricWindow
from dflash.trainer import state
from dflash.trainer.periodic_eval import PeriodicEval
from dflash.trainer.signals import StopRequested, stop_on_signals
from dflash.trainer.state import CheckpointSettings, DataPosition

log = logging.getLogger(__name__)


class SyncTrainer:
    def __init__(
        self,
        *,
        target: FrozenTarget,
        step_fn: DrafterStep,
        dataset: TokenDataset,
        planner: BatchPlanner,
        stop_after: int,
        log_every: int,
        checkpoints: CheckpointSettings,
    ):
        self.step_fn = step_fn
        self.drafter = step_fn.drafter
        self.drafter_device = step_fn.device
        self.target = target
        self.dataset, self.planner = dataset, planner
        self.stop_after, self.checkpoints = stop_after, checkpoints
        self.cadence = Cadence(
            stop_after=stop_after, log_every=log_every, checkpoint_every=checkpoints.every_steps
        )
        self.position = DataPosition()
        self.monitor: Monitor | None = None  # attached by the builder
        self.periodic_eval: PeriodicEval | None = None  # attached by the builder (eval.every_steps)
        self.batch_stats = BatchStats(planner.num_buckets)
        self._windows: deque[MetricWindow] = deque()
        # The same counters as the async workers; in one thread the drafter "waits" while the
        # batch is collated and the target runs, and the target waits while the drafter steps.
        self.target_counters = WorkCounters("target0")
        self.drafter_counters = WorkCounters("drafter0", counts_anchors=True)
        self.train_wall_s = 0.0
        self.replica_digest: str | None = None

    # -- probe for the monitor ---------------------------------------------------------------
    def completed_windows(self, wait: bool) -> list[list[MetricWindow]]:
        done = []
        while self._windows and (wait or self._windows[0].is_ready()):
            window = self._windows.popleft()
            if window.ready is not None:
                window.ready.synchronize()
            done.append([window])
        return done

    def pipeline_stats(self) -> dict[str, float]:
        return {
            **self.batch_stats.snapshot(),
            **self.target_counters.stats(),
            **self.drafter_counters.stats(),
        }

    def role_summary(self) -> dict[str, float]:
        return role_summary(
            targets=[self.target_counters], drafters=[self.drafter_counters], wall_s=self.train_wall_s
        )

    def role_devices(self) -> dict[str, list[torch.device]]:
        return {"target": [self.target.device], "drafter": [self.drafter_device]}

    # -- checkpoints -------------------------------------------------------------------------
    def restore(self, directory) -> None:
        self.position = state.restore(directory, [self.step_fn])

    def save(self):
        return state.save(self.checkpoints, self.step_fn, self.position)

    # -- loop --------------------------------------------------------------------------------
    def _train_one(self, seq: int) -> None:
        started = time.perf_counter()
        batch = collate(self.dataset, self.planner.at(seq))
        self.batch_stats.record(batch.plan.bucket, batch.lengths.numpy())
        collated = time.perf_counter()
        target_span = DeviceSpan.start(self.target.device)
        features = self.target.features(batch.input_ids.to(self.target.device))
        target_span.stop()
        targeted = time.perf_counter()
        drafter_span = DeviceSpan.start(self.drafter_device)
        anchors = self.step_fn(batch, features, self.position.step)
        drafter_span.stop()
        done = time.perf_counter()
        self.target_counters.record(
            batch,
            waited_s=(collated - started) + (done - targeted),
            busy_s=targeted - collated,
            span=target_span,
        )
        self.drafter_counters.record(
            batch, waited_s=targeted - started, busy_s=done - targeted, anchors=anchors, span=drafter_span
        )

    def run(self) -> None:
        started = time.perf_counter()
        with stop_on_signals() as stop:
            while self.position.step < self.stop_after:
                if stop.is_set():
                    log.warning("stop requested at step %d: writing a checkpoint", self.position.step)
                    self.save()
                    raise StopRequested(stop.signum)
                seq = self.position.next_seq
                self._train_one(seq)
                self.position = DataPosition(next_seq=seq + 1, step=self.position.step + 1)
                step = self.position.step
                if self.cadence.logs_at(step):
                    self._windows.append(self.step_fn.metrics.publish(step, self.step_fn.lr))
                self.monitor.maybe_tick()
                if self.periodic_eval is not None:
                    self.periodic_eval.offer(step, self.drafter)
                    self.periodic_eval.run_pending(should_stop=stop.is_set)
                if self.cadence.checkpoints_at(step):
                    self.save()
        self.train_wall_s = time.perf_counter() - started
        self.monitor.maybe_tick(wait=True, force=True)
        self.replica_digest = check_replicas_identical([self.drafter], ProcessGroupInfo())
        self.save()
