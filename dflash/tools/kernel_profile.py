"""Benchmarks' kernel tables: where a step's device time goes, top kernels first, and where the
device sat idle between kernels (the time no kernel table shows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DeviceActivity:
    """One kernel, copy or memset on the device: [start_us, end_us)."""

    name: str
    start_us: float
    end_us: float


@dataclass(frozen=True)
class IdleGap:
    start_us: float
    end_us: float
    before: str  # the activity that ended last before the gap
    after: str  # the activity that started the busy period after it

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def idle_gaps(activities: Sequence[DeviceActivity]) -> tuple[float, float, list[IdleGap]]:
    """(span_us, busy_us, gaps longest first) of the union of the activities' intervals.

    Overlapping activities (several streams) count once: busy is the time at least one ran."""
    ordered = sorted(activities, key=lambda a: a.start_us)
    if not ordered:
        return 0.0, 0.0, []
    gaps = []
    busy = 0.0
    run_start, run_end, last = ordered[0].start_us, ordered[0].end_us, ordered[0]
    for activity in ordered[1:]:
        if activity.start_us > run_end:
            busy += run_end - run_start
            gaps.append(IdleGap(run_end, activity.start_us, before=last.name, after=activity.name))
            run_start = activity.start_us
        if activity.end_us >= run_end:
            run_end, last = activity.end_us, activity
    busy += run_end - run_start
    span = run_end - ordered[0].start_us
    return span, busy, sorted(gaps, key=lambda g: g.duration_us, reverse=True)


def idle_report(activities: Sequence[DeviceActivity], *, steps: int, top: int = 12) -> str:
    span, busy, gaps = idle_gaps(activities)
    lines = [
        f"device span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, idle {(span - busy) / 1e3:.3f} ms "
        f"over {steps} back-to-back calls (per call: idle {(span - busy) / 1e3 / steps:.3f} ms, "
        f"{len(gaps) / steps:.0f} gaps)",
        "longest gaps (us, from the span's start; the kernel before -> the kernel after):",
    ]
    origin = min((a.start_us for a in activities), default=0.0)
    for gap in gaps[:top]:
        lines.append(
            f"  {gap.duration_us:9.1f} us at {gap.start_us - origin:10.1f}: {gap.before[:70]} -> {gap.after[:70]}"
        )
    return "\n".join(lines)


def write_kernel_table(step: Callable[[], object], path: Path, repeats: int = 2) -> None:
    """torch.profiler over `repeats` back-to-back calls of `step` (CPU and CUDA activity) into
    `path`: on CUDA, ops by device time with their children, the kernels by their own time, and
    the device's idle time between kernels with its longest gaps; on CPU, ops by host time.
    Run `step` once before: a first call's lazy setup is not the step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        if on_cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    if on_cuda:  # ops with their children's kernels, then the kernels themselves
        text = averages.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
        text += "\n" + averages.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    else:
        text = averages.table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=90)
    if on_cuda:
        device_events = [
            DeviceActivity(event.name, event.time_range.start, event.time_range.end)
            for event in prof.events()
            if event.device_type == DeviceType.CUDA
        ]
        text += "\n" + idle_report(device_events, steps=repeats) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
