"""Proof that data-parallel drafter replicas hold the same weights, bit for bit.

Replicas start from one initialization and apply the same summed update, so they must stay
identical; a silent divergence (a missed gradient, a race in the hand-over) would train N
different drafters and export one of them. At the end of a run every replica's weights are
reduced to a digest on its device, the digests of all replicas of all processes are compared,
and a mismatch stops the run naming the replicas that disagree.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from dflash.distributed import ProcessGroupInfo

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_digest(module: nn.Module) -> str:
    """A hex digest of the exact bit patterns of every parameter (name and order included).

    Each tensor is reduced on its device to a position-weighted sum of its bit patterns (integer
    arithmetic: the same bits give the same sum on any device), then the sums are hashed. Reads
    one small tensor back: call it outside the hot path.
    """
    named = list(module.named_parameters())
    sums = []
    for _, param in named:
        flat = param.detach().contiguous().view(-1)
        bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64) % 65521 + 1
        sums.append(torch.stack([bits.sum(), (bits * weights).sum()]))
    values = torch.stack(sums).cpu().tolist()
    hasher = hashlib.sha256()
    for (name, _), value in zip(named, values):
        hasher.update(f"{name}:{value[0]}:{value[1]};".encode())
    return hasher.hexdigest()[:16]


def check_replicas_identical(drafters: list[nn.Module], group: ProcessGroupInfo) -> str:
    """The digest every replica of every process agrees on; raises RuntimeError if any differs."""
    local = [weights_digest(drafter) for drafter in drafters]
    everyone = [local]
    if group.world_size > 1:
        everyone = [None] * group.world_size
        dist.all_gather_object(everyone, local)
    reference = everyone[0][0]
    differing = [
        f"rank {rank} replica {replica}: {digest}"
        for rank, digests in enumerate(everyone)
        for replica, digest in enumerate(digests)
        if digest != reference
    ]
    if differing:
        raise RuntimeError(
            f"drafter replicas diverged (rank 0 replica 0: {reference}; {'; '.join(differing)}): "
            "the exported checkpoint would be one of several different drafters"
        )
    return reference
