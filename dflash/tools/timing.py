"""The median time of a function in milliseconds: CUDA events on a GPU (device time of the
work the call enqueues, read after each call), the host clock elsewhere. The benchmark scripts
(scripts/bench_*.py) time every row with it, so their figures compare."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], *, warmup: int, repeat: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def back_to_back_ms(fn: Callable[[], object], *, repeat: int, device: torch.device) -> float:
    """Mean milliseconds per call over `repeat` calls issued without waiting in between, as a
    training loop issues its steps: the host prepares call n+1 while the device still runs call
    n, so the time the device waits for the host at the start of every isolated call (what
    `median_ms` includes) is hidden wherever the host keeps ahead."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeat
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) * 1000 / repeat
