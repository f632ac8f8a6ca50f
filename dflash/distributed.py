"""Beyond one process: the same pipeline under torchrun (or SLURM's srun + torchrun).

Each process runs the pipeline over the GPUs it owns on its node (`dflash/config/devices.py`:
the node's GPUs divided evenly among its processes); drafter gradients and the logged metric
sums go across processes with torch.distributed (NCCL on GPU, gloo on CPU) inside the
replicas' gradient sync. Rank r trains on schedule positions r, r + W, r + 2W, ...
(W = world size). Rank 0 alone writes metrics, checkpoints and the final evaluation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessGroupInfo:
    rank: int = 0
    world_size: int = 1
    owns_group: bool = False  # we initialized it, so we tear it down

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def export_submitit_environment() -> None:
    """Under a multi-task submitit/SLURM job, describe the group the way torchrun would."""
    if "WORLD_SIZE" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    try:
        import submitit

        env = submitit.JobEnvironment()
    except (ImportError, RuntimeError):
        return  # not a submitit job: plain srun users launch torchrun themselves
    os.environ.update(
        RANK=str(env.global_rank),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.num_tasks // env.num_nodes),
        WORLD_SIZE=str(env.num_tasks),
        MASTER_ADDR=env.hostnames[0],
        MASTER_PORT=os.environ.get("MASTER_PORT", str(20000 + int(env.job_id.split("_")[0]) % 20000)),
    )


def init_from_env(home_device: str) -> ProcessGroupInfo:
    """Join the process group torchrun (or a multi-node submitit job) describes in the environment.

    `home_device` is this process's first drafter device: NCCL binds the process to it, and the
    cross-process gradient sum runs there.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return ProcessGroupInfo()
    device = torch.device(home_device)
    owns = not dist.is_initialized()
    if owns:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's communicator lives on the current device
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), owns)


def require_same_layout(group: ProcessGroupInfo, targets: list[str], drafters: list[str]) -> None:
    """Every rank must run as many drafter replicas as every other (ranks step in lockstep, one
    collective per step) and the same count of target workers (equal shares of the schedule)."""
    if group.world_size == 1:
        return
    mine = (len(targets), len(drafters))
    layouts: list[tuple[int, int] | None] = [None] * group.world_size
    dist.all_gather_object(layouts, mine)
    if any(layout != mine for layout in layouts):
        described = ", ".join(f"rank {r}: {t} target + {d} drafter" for r, (t, d) in enumerate(layouts))
        raise ValueError(
            f"the ranks resolved different gpu layouts ({described}); give every node the same "
            "gpu.* settings, the same visible GPU count and the same --nproc-per-node"
        )


def visible_cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
