"""Stateful property tests of the hidden-state queue against a plain model of it."""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dflash.pipeline.queues import HiddenStateQueue, QueueClosed

CAPACITY, BUCKETS = 4, 3


class HiddenStateQueueMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.queue = HiddenStateQueue(CAPACITY, BUCKETS)
        self.model: deque[tuple[int, int]] = deque()
        self.closed = False
        self.counter = 0

    @precondition(lambda self: len(self.model) < CAPACITY and not self.closed)
    @rule(bucket=st.integers(0, BUCKETS - 1))
    def put(self, bucket):
        self.queue.put(self.counter, self.counter, bucket)
        self.model.append((self.counter, bucket))
        self.counter += 1

    @precondition(lambda self: self.model)
    @rule()
    def get(self):
        assert self.queue.get() == self.model.popleft()[0]  # in key order, also after close (drains)

    @precondition(lambda self: self.closed and not self.model)
    @rule()
    def get_after_close_and_drain_raises(self):
        try:
            self.queue.get()
        except QueueClosed:
            return
        raise AssertionError("get() on a closed, empty queue must raise QueueClosed")

    @precondition(lambda self: self.closed)
    @rule(bucket=st.integers(0, BUCKETS - 1))
    def put_after_close_raises(self, bucket):
        try:
            self.queue.put(self.counter, -1, bucket)
        except QueueClosed:
            return
        raise AssertionError("put() on a closed queue must raise QueueClosed")

    @rule()
    def close(self):
        self.queue.close()
        self.closed = True

    @invariant()
    def depths_match_the_model(self):
        assert self.queue.qsize() == len(self.model)
        assert self.queue.bucket_sizes() == [sum(b == k for _, b in self.model) for k in range(BUCKETS)]
        assert self.queue.fill_ratio() == len(self.model) / CAPACITY


HiddenStateQueueMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestHiddenStateQueue = HiddenStateQueueMachine.TestCase
