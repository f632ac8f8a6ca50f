"""Cumulative per-worker counters (target workers, drafter replicas), read by the monitor."""

from __future__ import annotations

import threading

from dflash.data.collate import Batch


class WorkCounters:
    """Host-side counts of one worker; `record` from its thread, `stats` from the monitor's.

    Keys follow the monitor's convention: `count/<name>_*` are cumulative counts (logged as
    `worker/<name>_*`, rates derived), `worker/<name>_*_total_s` cumulative seconds (logged as
    the share of each tick's wall time).
    """

    def __init__(self, name: str, counts_anchors: bool = False):
        self.name = name
        self.counts_anchors = counts_anchors
        self._lock = threading.Lock()
        self.batches = self.samples = self.tokens = self.anchors = 0
        self.busy_s = self.wait_s = 0.0

    def record(self, batch: Batch, waited_s: float, busy_s: float, anchors: int = 0) -> None:
        with self._lock:
            self.batches += 1
            self.samples += len(batch.plan.sample_ids)
            self.tokens += batch.real_tokens
            self.anchors += anchors
            self.wait_s += waited_s
            self.busy_s += busy_s

    def stats(self) -> dict[str, float]:
        with self._lock:
            name = self.name
            stats = {
                f"count/{name}_batches": float(self.batches),
                f"count/{name}_samples": float(self.samples),
                f"count/{name}_tokens": float(self.tokens),
                f"worker/{name}_busy_total_s": self.busy_s,
                f"worker/{name}_wait_total_s": self.wait_s,
            }
            if self.counts_anchors:
                stats[f"count/{name}_anchors"] = float(self.anchors)
            return stats
