"""BatchPrefetcher: walks the batch schedule, collates on worker threads, feeds target devices.

One feed thread walks the schedule in order and dispatches each batch to a target device
through ONE shared, lock-protected round-robin counter (per-worker counters drifted out of
phase and skewed queue depths in the system we replace): over any window of k*T dispatches,
each of the T devices receives exactly k. Worker threads collate, pad and pin; each device's
queue releases its batches in dispatch order whichever worker finished first.
"""

from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from dflash.data.collate import Batch, collate
from dflash.data.dataset import TokenDataset
from dflash.data.scheduler import BatchPlanner
from dflash.pipeline.queues import OrderedQueue, QueueClosed


@dataclass
class Dispatched:
    seq: int  # this process's position in the schedule (across epochs)
    order: int  # dispatch index in this run (0, 1, 2, ...): the hidden-state queue releases by it
    batch: Batch


class BatchStats:
    """Running counters updated at dispatch; `snapshot()` is atomic (taken under the lock)."""

    def __init__(self, num_buckets: int):
        self._lock = threading.Lock()
        self.bucket_counts = np.zeros(num_buckets, dtype=np.int64)
        self.batches = 0
        self.samples = 0
        self.seq_len_sum = 0
        self.seq_len_max = 0
        self.real_tokens = 0
        self.padded_tokens = 0

    def record(self, bucket: int, lengths: np.ndarray) -> None:
        with self._lock:
            self._record(bucket, lengths)

    def _record(self, bucket: int, lengths: np.ndarray) -> None:
        self.bucket_counts[bucket] += 1
        self.batches += 1
        self.samples += len(lengths)
        self.seq_len_sum += int(lengths.sum())
        self.seq_len_max = max(self.seq_len_max, int(lengths.max()))
        self.real_tokens += int(lengths.sum())
        self.padded_tokens += int(lengths.max()) * len(lengths)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            batches = max(1, self.batches)
            shares = self.bucket_counts / batches
            stats = {f"batch/bucket_{i}_pct": 100.0 * s for i, s in enumerate(shares)}
            nonzero = shares[shares > 0]
            stats.update(
                {
                    "batch/dispatched": float(self.batches),
                    "batch/avg_seq_len": self.seq_len_sum / max(1, self.samples),
                    "batch/max_seq_len": float(self.seq_len_max),
                    "batch/batch_size": self.samples / batches,
                    "batch/padding_efficiency": self.real_tokens / max(1, self.padded_tokens),
                    "batch/avg_total_tokens": self.padded_tokens / batches,
                    "batch/bucket_entropy": float(-(nonzero * np.log(nonzero)).sum())
                    / math.log(max(2, len(shares))),
                }
            )
            return stats


class BatchPrefetcher:
    def __init__(
        self,
        *,
        dataset: TokenDataset,
        planner: BatchPlanner,
        target_devices: list[torch.device],
        num_workers: int,
        depth_per_device: int,
        start_seq: int,
        end_seq: int,
        skip_seqs: set[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.dataset, self.planner = dataset, planner
        self.devices = target_devices
        self.start_seq, self.end_seq = start_seq, end_seq
        self.skip_seqs = skip_seqs or set()
        # Multi-node: this process's seq s is schedule position s * world_size + rank.
        self.rank, self.world_size = rank, world_size
        self.device_queues = [OrderedQueue[Dispatched](depth_per_device) for _ in target_devices]
        self._work: queue.Queue = queue.Queue(maxsize=max(2, num_workers * 2))
        self._lock = threading.Lock()
        self._round_robin = 0  # the ONE shared dispatch counter
        self._per_device_keys = [0] * len(target_devices)
        self.stats = BatchStats(planner.num_buckets)
        self.num_workers = num_workers
        self.pin = any(d.type == "cuda" for d in target_devices)
        self._stop = threading.Event()

    def dispatch(self, bucket: int, lengths: np.ndarray) -> tuple[int, int, int]:
        """Assign the next batch to a target device; returns (device index, key in its queue,
        dispatch index)."""
        with self._lock:
            order = self._round_robin
            device = order % len(self.devices)
            self._round_robin += 1
            key = self._per_device_keys[device]
            self._per_device_keys[device] += 1
            self.stats.record(bucket, lengths)  # inside the dispatch lock: counts follow dispatch order
            return device, key, order

    def get_batch_stats(self) -> dict[str, float]:
        return self.stats.snapshot()

    def feed(self) -> None:
        """The feed thread: walk the schedule, dispatch, hand collation to the workers."""
        try:
            for seq in range(self.start_seq, self.end_seq):
                if seq in self.skip_seqs:
                    continue
                plan = self.planner.at(seq * self.world_size + self.rank)
                lengths = self.dataset.lengths[list(plan.sample_ids)]
                device, key, order = self.dispatch(plan.bucket, lengths)
                while not self._stop.is_set():
                    try:
                        self._work.put((seq, order, plan, device, key), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        finally:
            for _ in range(self.num_workers):
                self._put_sentinel()

    def _put_sentinel(self) -> None:
        while not self._stop.is_set():
            try:
                self._work.put(None, timeout=0.1)
                return
            except queue.Full:
                continue

    def work(self) -> None:
        """A collate worker thread."""
        while not self._stop.is_set():
            try:
                item = self._work.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, order, plan, device, key = item
            batch = collate(self.dataset, plan)
            if self.pin:
                batch = batch.pin_memory()
            try:
                self.device_queues[device].put(key, Dispatched(seq, order, batch))
            except QueueClosed:
                return

    def close(self) -> None:
        self._stop.set()
        for device_queue in self.device_queues:
            device_queue.close()
