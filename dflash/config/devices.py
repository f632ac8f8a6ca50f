"""Which devices this process gives to the target and drafter roles (the `gpu` group).

A node's visible CUDA devices are divided evenly among the processes torchrun starts on it
(LOCAL_WORLD_SIZE of them); process LOCAL_RANK owns the contiguous slice
`[LOCAL_RANK * per_process, (LOCAL_RANK + 1) * per_process)` and splits only that slice
between its roles. So a user picks the process layout with torchrun alone:

- `torchrun --nproc-per-node=N ... gpu=single` on N GPUs: one GPU per process, both roles on it;
- `torchrun --nproc-per-node=1 ... gpu=split gpu.target=T`: one process per node owning all of
  the node's GPUs, T of them targets and the rest drafter replicas;
- anything between (`--nproc-per-node=2` on 8 GPUs with `gpu=split gpu.target=1`: two processes
  of 1 target + 3 drafter GPUs each).

Everything here reads the environment and the config only: no device is touched, no process
group is joined, so layout errors surface before any model loads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dflash.config.bounds import at_least
from dflash.config.schema import DeviceKind


@dataclass(frozen=True)
class ProcessSlot:
    """This process's place among the processes of its node and of the job (torchrun's variables)."""

    local_rank: int = 0
    local_world_size: int = 1
    world_size: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProcessSlot:
        env = os.environ if env is None else env
        world_size = int(env.get("WORLD_SIZE", "1"))
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
        slot = cls(int(env.get("LOCAL_RANK", "0")), local_world_size, world_size)
        if world_size % local_world_size:
            raise ValueError(
                f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world_size}: every "
                "node must run the same number of processes (the same --nproc-per-node on every node)"
            )
        return slot


def _visible_note() -> str:
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={hidden!r})" if hidden is not None else ""


def owned_cuda_devices(visible_cuda_devices: int, slot: ProcessSlot) -> list[int]:
    """The CUDA device indices this process owns on its node."""
    if visible_cuda_devices == 0:
        raise ValueError(f"gpu.device=cuda but no CUDA device is visible{_visible_note()}; use gpu=cpu")
    per_process, rest = divmod(visible_cuda_devices, slot.local_world_size)
    if per_process == 0:
        raise ValueError(
            f"{slot.local_world_size} processes on this node (torchrun --nproc-per-node) but only "
            f"{visible_cuda_devices} CUDA device(s) visible{_visible_note()}: two ranks would share a GPU; "
            f"use --nproc-per-node <= {visible_cuda_devices}"
        )
    if rest:
        raise ValueError(
            f"{visible_cuda_devices} visible CUDA devices{_visible_note()} do not divide evenly among "
            f"{slot.local_world_size} processes on this node (torchrun --nproc-per-node); every process "
            "must own the same number of GPUs"
        )
    first = slot.local_rank * per_process
    return list(range(first, first + per_process))


def resolve_device_split(
    cfg: Any, visible_cuda_devices: int, slot: ProcessSlot | None = None
) -> tuple[list[str], list[str]]:
    """(target devices, drafter devices) of this process, from the `gpu` group.

    gpu.shared (gpu=single): the drafter replicas go round-robin onto the target devices
    (several replicas may share one device). Otherwise the roles get disjoint devices:
    gpu.target targets first, then gpu.drafter (null: the rest) drafter replicas.
    """
    gpu = cfg.gpu
    slot = slot or ProcessSlot()
    at_least("gpu.target", gpu.target, 1)
    if gpu.drafter is not None and gpu.drafter < 1:
        raise ValueError(f"gpu.drafter must be >= 1 (or null for the rest), got {gpu.drafter}")
    if gpu.device is DeviceKind.cpu:
        drafters = gpu.drafter or 1
        return ["cpu"] * gpu.target, ["cpu"] * drafters
    owned = [f"cuda:{i}" for i in owned_cuda_devices(visible_cuda_devices, slot)]
    where = (
        f"{len(owned)} CUDA devices per process ({slot.local_world_size} processes on this node)"
        if slot.local_world_size > 1
        else f"{len(owned)} visible CUDA devices{_visible_note()}"
    )
    if gpu.shared:
        if gpu.target > len(owned):
            raise ValueError(f"gpu.target={gpu.target} target devices (gpu.shared=true) but {where}")
        targets = owned[: gpu.target]
        drafters = gpu.drafter if gpu.drafter is not None else gpu.target
        return targets, [targets[i % len(targets)] for i in range(drafters)]
    drafters = gpu.drafter if gpu.drafter is not None else len(owned) - gpu.target
    if drafters < 1 or gpu.target + drafters > len(owned):
        raise ValueError(
            f"gpu.target={gpu.target} + gpu.drafter={gpu.drafter if gpu.drafter is not None else 'rest'} "
            f"needs {gpu.target + max(drafters, 1)} CUDA devices; {where}"
        )
    return owned[: gpu.target], owned[gpu.target : gpu.target + drafters]
