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
