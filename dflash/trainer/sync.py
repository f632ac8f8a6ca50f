"""The reference trainer (`pipeline=sync`): target forward, then the drafter step, in one thread.

It is the correctness oracle for the asynchronous pipeline and its performance baseline. Its
lifecycle (signals, cadence, final checkpoint) is `Trainer`'s; it exposes the same probe to the
monitor (windows, batch stats, counters), and the monitor ticks between steps, on this thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from dflash.data.collate import collate
from dflash.pipeline.counters import DeviceSpan, WorkCounters
from dflash.pipeline.prefetch import BatchStats
from dflash.step.metrics import MetricWindow
from dflash.trainer.lifecycle import Trainer, TrainerInputs
from dflash.trainer.signals import StopSignal
from dflash.trainer.state import DataPosition

log = logging.getLogger(__name__)


class SyncTrainer(Trainer):
    def __init__(self, *, inputs: TrainerInputs):
        if len(inputs.targets) != 1 or len(inputs.step_fns) != 1:
            raise ValueError(
                "pipeline=sync runs one target and one drafter, "
                f"got {len(inputs.targets)} and {len(inputs.step_fns)}"
            )
        super().__init__(inputs=inputs)
        self.drafter_device = self.step_fn.device
        self.batch_stats = BatchStats(self.planner.num_buckets)
        self._windows: deque[MetricWindow] = deque()
        # The same counters as the async workers; in one thread the drafter "waits" while the
        # batch is collated and the target runs, and the target waits while the drafter steps.
        self.target_counters = WorkCounters("target0")
        self.drafter_counters = WorkCounters("drafter0", counts_anchors=True)

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

    def _role_counters(self) -> tuple[list[WorkCounters], list[WorkCounters]]:
        return [self.target_counters], [self.drafter_counters]

    def role_devices(self) -> dict[str, list[torch.device]]:
        return {"target": [self.target.device], "drafter": [self.drafter_device]}

    # -- loop --------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Nothing to build ahead: each batch is collated when it is trained on."""
        return None

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

    def _train(self, stop: StopSignal) -> int | None:
        while self.position.step < self.stop_after:
            if stop.is_set():
                log.warning("stop requested at step %d: writing a checkpoint", self.position.step)
                return stop.signum
            seq = self.position.next_seq
            self._train_one(seq)
            self.position = DataPosition(next_seq=seq + 1, step=self.position.step + 1)
            step = self.position.step
            if self.cadence.logs_at(step):
                self._windows.append(self.step_fn.metrics.publish(step, self.step_fn.lr))
            self._stepped(step)
            self._observe(stop)
            if self.cadence.checkpoints_at(step):
                self.save()
        return None
