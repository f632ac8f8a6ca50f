"""Where dflash's optional GPU kernel libraries run (triton and flash-linear-attention, the `gpu`
extra): one answer for every path that picks between a kernel and its PyTorch formula. Nothing
here imports them."""

from __future__ import annotations

import importlib.util

import torch


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def triton_runs(device: torch.device) -> bool:
    """Triton kernels can run on `device`: CUDA, with triton installed."""
    return torch.device(device).type == "cuda" and installed("triton")


def fla_runs(device: torch.device) -> bool:
    """flash-linear-attention's kernels can run on `device`: CUDA, with fla installed."""
    return torch.device(device).type == "cuda" and installed("fla")
