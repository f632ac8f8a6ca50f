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
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    """The queue was closed: the pipeline is stopping."""


class _KeyWindow(Generic[T]):
    """A heap of `(key, ...)` entries released strictly in key order (0, 1, 2, ...), whichever
    order producers finish in; its capacity is a window over keys: key k may enter once
    k < next_key_to_release + capacity, so a producer holding the next key is never blocked
    behind later ones. Closing it wakes every waiter."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._heap: list[tuple] = []
        self._next = 0
        self._cond = threading.Condition()
        self._closed = False

    def _has_room(self, key: int) -> bool:
        return key < self._next + self.capacity

    def _ready(self) -> bool:
        return bool(self._heap) and self._heap[0][0] == self._next

    def _wait(self, until: Callable[[], bool]) -> float:
        """Under the lock: wait until `until()` holds or the queue closes; the seconds waited."""
        if until() or self._closed:
            return 0.0
        started = time.perf_counter()
        while not until() and not self._closed:
            self._cond.wait()
        return time.perf_counter() - started

    def _push(self, entry: tuple) -> None:
        heapq.heappush(self._heap, entry)
        self._cond.notify_all()

    def _pop(self) -> tuple:
        entry = heapq.heappop(self._heap)
        self._next += 1
        self._cond.notify_all()
        return entry

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def qsize(self) -> int:
        with self._cond:
            return len(self._heap)


class HiddenStateQueue(_KeyWindow[T]):
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
        super().__init__(capacity)
        self._buckets = Counter()
        self._num_buckets = num_buckets
        self.producer_wait_s = 0.0
        self.consumer_wait_s = 0.0

    def put(self, key: int, item: T, bucket: int) -> None:
        with self._cond:
            self.producer_wait_s += self._wait(lambda: self._has_room(key))
            if self._closed:
                raise QueueClosed
            self._buckets[bucket] += 1
            self._push((key, bucket, item))

    def get(self) -> T:
        """The next item; after `close`, the items whose turn has come still come out."""
        with self._cond:
            self.consumer_wait_s += self._wait(self._ready)
            if not self._ready():
                raise QueueClosed
            _, bucket, item = self._pop()
            self._buckets[bucket] -= 1
            return item

    def bucket_sizes(self) -> list[int]:
        with self._cond:
            return [self._buckets[b] for b in range(self._num_buckets)]

    def fill_ratio(self) -> float:
        return self.qsize() / self.capacity


class OrderedQueue(_KeyWindow[T]):
    """Releases items strictly in key order (0, 1, 2, ...), whichever order producers finish in.

    Several collate workers feed one target device; the device must still see its batches in
    dispatch order (that is what makes the async pipeline reproduce the sync one). Capacity is a
    window over keys: key k may enter once k < next_key_to_release + capacity, so a producer
    holding the next key is never blocked behind later ones.
    """

    def put(self, key: int, item: T) -> None:
        with self._cond:
            self._wait(lambda: self._has_room(key))
            if self._closed:
                raise QueueClosed
            self._push((key, item))

    def get(self) -> T:
        """The next item; none after `close`."""
        with self._cond:
            self._wait(self._ready)
            if self._closed:
                raise QueueClosed
            _, item = self._pop()
            return item
