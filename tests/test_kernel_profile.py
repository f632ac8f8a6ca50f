"""Benchmarks' --profile: a kernel table per step, the step's own ops in it."""

from __future__ import annotations

import torch

from dflash.tools.kernel_profile import write_kernel_table


def test_the_kernel_table_lists_the_steps_ops_with_their_call_counts(tmp_path):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    path = tmp_path / "tables" / "step.txt"
    write_kernel_table(lambda: torch.mm(a, b).relu(), path, repeats=3)
    rows = {line.split()[0]: line.split() for line in path.read_text().splitlines() if line.strip()}
    assert rows["aten::mm"][-1] == "3" and rows["aten::relu"][-1] == "3"


def test_idle_gaps_count_overlapping_kernels_once_and_name_each_gaps_neighbours():
    from dflash.tools.kernel_profile import DeviceActivity, idle_gaps, idle_report

    activities = [
        DeviceActivity("gemm", 0.0, 10.0),
        DeviceActivity("side_stream_copy", 2.0, 4.0),  # inside gemm: no gap, no extra busy time
        DeviceActivity("norm", 13.0, 15.0),  # 3 us gap after gemm
        DeviceActivity("adamw", 25.0, 30.0),  # 10 us gap after norm
        DeviceActivity("tail", 29.0, 31.0),  # overlaps adamw and ends the span
    ]
    span, busy, gaps = idle_gaps(list(reversed(activities)))  # any order in
    assert (span, busy) == (31.0, 18.0)
    assert [(g.duration_us, g.before, g.after) for g in gaps] == [
        (10.0, "norm", "adamw"),
        (3.0, "gemm", "norm"),
    ]
    report = idle_report(activities, steps=1)
    assert "idle 0.013 ms" in report and "norm -> adamw" in report.splitlines()[2]
