"""Collate a planned batch into padded tensors (right padding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.data.dataset import TokenDataset
from dflash.data.schedule import PlannedBatch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64, 0-padded
    attention_mask: torch.Tensor  # [B, S] int64, 1 on real tokens
    loss_mask: torch.Tensor  # [B, S] uint8, 1 on supervised tokens
    lengths: torch.Tensor  # [B] int64
    plan: PlannedBatch

    @property
    def sample_ids(self) -> list[int]:
        return list(self.plan.sample_ids)

    def pin_memory(self) -> Batch:
        """Page-locked copies, so host->device copies can be non-blocking."""
        return Batch(
            self.input_ids.pin_memory(),
            self.attention_mask.pin_memory(),
            self.loss_mask.pin_memory(),
            self.lengths,
            self.plan,
        )

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


def collate(dataset: TokenDataset, plan: PlannedBatch, pad_id: int = 0) -> Batch:
    samples = [dataset[i] for i in plan.sample_ids]
    seq_len = max(len(ids) for ids, _ in samples)
    batch = len(samples)
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.int64)
    loss_mask = torch.zeros((batch, seq_len), dtype=torch.uint8)
    for row, (ids, mask) in enumerate(samples):
        input_ids[row, : len(ids)] = ids
        attention_mask[row, : len(ids)] = 1
        loss_mask[row, : len(ids)] = mask
    lengths = attention_mask.sum(dim=1)
    return Batch(input_ids, attention_mask, loss_mask, lengths, plan)
