"""Collate a planned batch into padded tensors (right padding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.data.dataset import TokenDataset
from dflash.data.scheduler import PlannedBatch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64, 0-padded on the right (the only tensor sent to a device)
    loss_mask: torch.Tensor  # [B, S] uint8, 1 on supervised tokens (read on the host: anchors)
    lengths: torch.Tensor  # [B] int64
    plan: PlannedBatch

    @property
    def sample_ids(self) -> list[int]:
        return list(self.plan.sample_ids)

    def pin_memory(self) -> Batch:
        """Page-locked ids, so the host->device copy can be non-blocking."""
        return Batch(self.input_ids.pin_memory(), self.loss_mask, self.lengths, self.plan)

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


def collate(dataset: TokenDataset, plan: PlannedBatch, pad_id: int = 0) -> Batch:
    samples = [dataset[i] for i in plan.sample_ids]
    seq_len = max(len(ids) for ids, _ in samples)
    batch = len(samples)
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((batch, seq_len), dtype=torch.uint8)
    for row, (ids, mask) in enumerate(samples):
        input_ids[row, : len(ids)] = ids
        loss_mask[row, : len(ids)] = mask
    lengths = torch.tensor([len(ids) for ids, _ in samples], dtype=torch.int64)
    return Batch(input_ids, loss_mask, lengths, plan)
