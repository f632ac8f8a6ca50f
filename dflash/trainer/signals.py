"""SIGINT / SIGTERM -> a stop request the training loop honours at a step boundary.

The loop then writes a checkpoint and raises `StopRequested`; the entry point exits with
128 + signal number, as schedulers (SLURM preemption) expect.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class StopRequested(Exception):
    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; a checkpoint was written")
        self.signum = signum


class StopSignal:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None

    def request(self, signum: int) -> None:
        self.signum = signum
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


@contextmanager
def on_signals(handler):
    """Within the block, SIGINT and SIGTERM call `handler(signum, frame)` instead of killing us;
    the previous handlers come back after it.

    Only the main thread can install handlers; elsewhere (a test driving train() from a thread)
    the signals keep their default behaviour."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)


@contextmanager
def stop_on_signals():
    """Within the block, SIGINT and SIGTERM set the returned StopSignal instead of killing us."""
    stop = StopSignal()
    with on_signals(lambda signum, frame: stop.request(signum)):
        yield stop
