"""Cumulative per-worker counters (target workers, drafter replicas), read by the monitor."""

from __future__ import annotations

import re
import threading
import time
from collections import deque

import torch

from dflash.data.collate import Batch


class DeviceSpan:
    """The device time of work a thread queues on its current stream, without waiting for it.

    `start()` and `stop()` record CUDA events on the current stream; whoever reads the time later
    (the monitor) polls `done()` and never blocks. On CPU the work ran synchronously, so the
    span is the host time between the two calls.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._host_start = self._host_end = 0.0

    @classmethod
    def start(cls, device: torch.device) -> DeviceSpan:
        span = cls(device)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(torch.cuda.current_stream(device))
            span._events = (begin, end)
        else:
            span._host_start = time.perf_counter()
        return span

    def stop(self) -> DeviceSpan:
        if self._events is not None:
            self._events[1].record(torch.cuda.current_stream(self.device))
        else:
            self._host_end = time.perf_counter()
        return self

    def done(self) -> bool:
        return self._events is None or self._events[1].query()

    def seconds(self) -> float:
        """Only once `done()`: reading an unfinished CUDA span would wait for the device."""
        if self._events is None:
            return self._host_end - self._host_start
        return self._events[0].elapsed_time(self._events[1]) / 1000.0


class WorkCounters:
    """Host-side counts of one worker; `record` from its thread, `stats` from the monitor's.

    Keys follow the monitor's convention: `count/<name>_*` are cumulative counts (logged as
    `worker/<name>_*`, rates derived), `worker/<name>_*_total_s` cumulative seconds (logged as
    the share of each tick's wall time). `busy` is host time inside the worker's step (on a GPU
    mostly kernel launches); `compute` is the device time of the step's kernels, the figure that
    says how loaded a role's GPU is.
    """

    def __init__(self, name: str, counts_anchors: bool = False):
        self.name = name
        self.counts_anchors = counts_anchors
        self._lock = threading.Lock()
        self.batches = self.samples = self.tokens = self.anchors = 0
        self.busy_s = self.wait_s = 0.0
        self._compute_s = 0.0
        self._computed_batches = 0  # batches whose device time is in _compute_s
        self._spans: deque[DeviceSpan] = deque()

    def record(
        self,
        batch: Batch,
        *,
        waited_s: float,
        busy_s: float,
        anchors: int = 0,
        span: DeviceSpan | None = None,
    ) -> None:
        with self._lock:
            self.batches += 1
            self.samples += len(batch.plan.sample_ids)
            self.tokens += batch.real_tokens
            self.anchors += anchors
            self.wait_s += waited_s
            self.busy_s += busy_s
            if span is not None:
                self._spans.append(span)

    def _collect_spans(self) -> None:
        while self._spans and self._spans[0].done():
            self._compute_s += self._spans.popleft().seconds()
            self._computed_batches += 1

    def stats(self) -> dict[str, float]:
        with self._lock:
            self._collect_spans()
            name = self.name
            stats = {
                f"count/{name}_batches": float(self.batches),
                f"count/{name}_samples": float(self.samples),
                f"count/{name}_tokens": float(self.tokens),
                # the batches `compute_total_s` covers (a step's device time is read once its
                # end event has completed, so this trails `batches` by the steps in flight)
                f"count/{name}_timed_batches": float(self._computed_batches),
                f"worker/{name}_busy_total_s": self.busy_s,
                f"worker/{name}_wait_total_s": self.wait_s,
                f"worker/{name}_compute_total_s": self._compute_s,
            }
            if self.counts_anchors:
                stats[f"count/{name}_anchors"] = float(self.anchors)
            return stats


def drafter_totals(stats: dict[str, float], name: str) -> float:
    """`name` (samples, tokens, anchors, batches) summed over every drafter replica's counters in
    a `pipeline_stats()` dict: what the whole job has trained on so far."""
    key = re.compile(rf"count/drafter\d+_{name}")  # exact: `batches` must not match `timed_batches`
    return sum(v for k, v in stats.items() if key.fullmatch(k))
