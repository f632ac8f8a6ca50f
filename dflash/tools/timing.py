"""Benchmark timers in milliseconds, on `dflash.stopwatch.Stopwatch` (CUDA events on a GPU, the
host clock elsewhere). The benchmark scripts (scripts/bench_*.py) time every row with them, so
their figures compare."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from dflash.stopwatch import Stopwatch


def elapsed_ms(run: Callable[[], object], device: torch.device) -> float:
    """Milliseconds one call of `run` takes, waiting for the device work it enqueued."""
    _, seconds = Stopwatch(device)(run)
    return seconds * 1000


def median_ms(fn: Callable[[], object], *, warmup: int, repeat: int, device: torch.device) -> float:
    """The median of `repeat` isolated calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn, device) for _ in range(repeat))


def back_to_back_ms(fn: Callable[[], object], *, repeat: int, device: torch.device) -> float:
    """Mean milliseconds per call over `repeat` calls issued without waiting in between, as a
    training loop issues its steps: the host prepares call n+1 while the device still runs call
    n, so the time the device waits for the host at the start of every isolated call (what
    `median_ms` includes) is hidden wherever the host keeps ahead."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # earlier work must not count as this run's

    def every_call() -> None:
        for _ in range(repeat):
            fn()

    return elapsed_ms(every_call, device) / repeat
