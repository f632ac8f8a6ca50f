"""Elapsed time of one call: CUDA events on a GPU (the device time of the work the call
enqueues, read once it is done), the host clock elsewhere. dflash-eval times its decoding with
it; the benchmark timers (dflash/tools/timing.py) build on it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class Stopwatch:
    """Elapsed seconds of a callable: CUDA events on GPU (no host sync inside), else wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args)
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end) / 1000.0
        started = time.perf_counter()
        result = fn(*args)
        return result, time.perf_counter() - started
