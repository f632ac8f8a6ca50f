"""Bounded, closable queues between pipeline threads.

Every blocking call wakes up when the queue is closed (shutdown or a failure elsewhere) and then
raises `QueueClosed`, so no thread can stay blocked on a queue after the job ends. Counters are
read under the queue's lock and are cheap.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    """The queue was closed: the pipeline is stopping."""


class HiddenStateQueue(Generic[T]):
    """From target workers to drafter loops, released in dispatch order, bounded at `capacity`.

    Packets carry the dispatch index the prefetcher gave their batch (0, 1, 2, ... in this
    process) and leave strictly in that order, whichever target worker finished first: the D
    replicas of step k train on batches kD .. kD+D-1 with any number of target devices, so a
    multi-target run trains on exactly the batches, step by step, of a one-target run.
    Capacity is a window over keys, as in `OrderedQueue`: key k may enter once
    k < next_key_to_release + capacity, so the worker holding the next packet is never blocked
    behind later ones (no deadlock) and at most `capacity` packets wait. Producers blocked at
    the window count as producer wait time. Depth is also kept per length bucket so the
    monitor can see which buckets are piling up.
    """

    def __init__(self, capacity: int, num_buckets: int):
        assert capacity >= 1
        self.capacity = capacity
        self._heap: list[tuple[int, int, T]] = []  # (key, bucket, item)
        self._next = 0
        self._buckets = Counter()
        self._num_buckets = num_buckets
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self.producer_wait_s = 0.0
        self.consumer_wait_s = 0.0

    def put(self, key: int, item: T, bucket: int) -> None:
        with self._lock:
            if key >= self._next + self.capacity and not self._closed:
                started = time.perf_counter()
                while key >= self._next + self.capacity and not self._closed:
                    self._changed.wait()
                self.producer_wait_s += time.perf_counter() - started
            if self._closed:
                raise QueueClosed
            heapq.heappush(self._heap, (key, bucket, item))
            self._buckets[bucket] += 1
            self._changed.notify_all()

    def _ready(self) -> bool:
        return bool(self._heap) and self._heap[0][0] == self._next

    def get(self) -> T:
        with self._lock:
            if not self._ready() and not self._closed:
                started = time.perf_counter()
                while not self._ready() and not self._closed:
                    self._changed.wait()
                self.consumer_wait_s += time.perf_counter() - started
            if not self._ready():
                raise QueueClosed
            _, bucket, item = heapq.heappop(self._heap)
            self._next += 1
            self._buckets[bucket] -= 1
            self._changed.notify_all()
            return item

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    def qsize(self) -> int:
        with self._lock:
            return len(self._heap)

    def bucket_sizes(self) -> list[int]:
        with self._lock:
            return [self._buckets[b] for b in range(self._num_buckets)]

    def fill_ratio(self) -> float:
        return self.qsize() / self.capacity


class OrderedQueue(Generic[T]):
    """Releases items strictly in key order (0, 1, 2, ...), whichever order producers finish in.

    Several collate workers feed one target device; the device must still see its batches in
    dispatch order (that is what makes the async pipeline reproduce the sync one). Capacity is a
    window over keys: key k may enter once k < next_key_to_release + capacity, so a producer
    holding the next key is never blocked behind later ones.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._heap: list[tuple[int, Any]] = []
        self._next = 0
        self._cond = threading.Condition()
        self._closed = False

    def put(self, key: int, item: T) -> None:
        with self._cond:
            while key >= self._next + self.capacity and not self._closed:
                self._cond.wait()
            if self._closed:
                raise QueueClosed
            heapq.heappush(self._heap, (key, item))
            self._cond.notify_all()

    def get(self) -> T:
        with self._cond:
            while not (self._heap and self._heap[0][0] == self._next) and not self._closed:
                self._cond.wait()
            if self._closed:
                raise QueueClosed
            _, item = heapq.heappop(self._heap)
            self._next += 1
            self._cond.notify_all()
            return item

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def qsize(self) -> int:
        with self._cond:
            return len(self._heap)
