"""Benchmarks' kernel tables: where a step's device time goes, top kernels first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def write_kernel_table(step: Callable[[], object], path: Path, repeats: int = 2) -> None:
    """torch.profiler over `repeats` calls of `step` (CPU and CUDA activity), its table sorted
    by device time into `path`. Run `step` once before: a first call's lazy setup is not the step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=90))
