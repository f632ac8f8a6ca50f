"""SIGINT / SIGTERM -> a stop request the training loop honours at a step boundary.

The loop then writes a checkpoint and raises `StopRequested`; the entry point exits with
128 + signal number, as schedulers (SLURM preemption) expect.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager

log = logging.getLogger(__name__)


class StopRequested(Exception):
    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; a checkpoint was written")
        self.signum = signum


# Once a stop is under way (a signal honoured by a StopSignal, or the job's record being
# written), later signals are noted instead of raised: three Ctrl-C within a fraction of a
# second must not break off the checkpoint, summary or run record the first one asked for.
_stopping = threading.Event()
_late_signals: list[int] = []


class StopSignal:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None

    def request(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
        self.event.set()
        _stopping.set()

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


def compile_cut_by_stop(error: BaseException, stop: StopSignal) -> bool:
    """Whether `error`, raised by a training step, is a compile that a stop request broke off;
    if so it is logged and the run stops at its last finished step, as asked. `timeout`,
    batch schedulers and a terminal's Ctrl-C signal the whole process group, and the compilers'
    own processes in it (Inductor's compile workers, g++, ptxas) die mid-compile: the step
    being compiled never updated a weight, so the checkpoint of the steps before it is whole.
    Without a stop request a failed compile is a failure like any other."""
    if not stop.is_set():
        return False
    from torch._dynamo.exc import BackendCompilerFailed  # Inductor's errors derive from it

    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, BackendCompilerFailed):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return False
    inner = getattr(cause, "inner_exception", None) or cause  # the backend's own error
    lines = str(inner).strip().splitlines()
    log.warning(
        "stop requested while compiling: the compile failed as the signal reached the compiler's "
        "processes too (%s%s); stopping at the last step finished",
        type(inner).__name__,
        f": {lines[0][:200]}" if lines else "",
    )
    return True


@contextmanager
def stop_on_signals():
    """Within the block, SIGINT and SIGTERM set the returned StopSignal instead of killing us."""
    stop = StopSignal()
    with on_signals(lambda signum, frame: stop.request(signum)):
        yield stop


def _job_handler(signum, frame) -> None:
    if _stopping.is_set():
        _late_signals.append(signum)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def install_job_signals() -> dict:
    """For one job, from its start to its record (the run-record callback): before training a
    signal ends the job as Python's defaults would (SIGTERM through SystemExit, so cleanups
    run); once a stop is under way, later signals are only noted (`late_signal`). Returns the
    handlers to put back (`restore_job_signals`)."""
    _stopping.clear()
    _late_signals.clear()
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, _job_handler)
    return previous


def begin_shutdown() -> None:
    """From here on signals are noted, not raised (the job's record is being written)."""
    _stopping.set()


def late_signal() -> int | None:
    """The first signal noted while stopping, or None."""
    return _late_signals[0] if _late_signals else None


def ignore_signals_until_exit() -> None:
    """The record is written and the process is ending: later signals are ignored (the
    interpreter's teardown would otherwise restore the default handlers, and a signal then
    would end the process with another status than the one it is exiting with)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def restore_job_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
