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
