"""DFlash loss: gamma-weighted cross-entropy, unweighted per-position accuracy, tau_sim.

The loss is reduced as (sum of w * CE, sum of w) and divided once by whoever owns the whole
step: with several replicas or accumulation, a replica that drew short or empty batches must
not weigh as much as one that drew full ones (DESIGN section 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash.blocks import DraftBlocks


@dataclass
class LossStats:
    """Device tensors; nothing here syncs with the host."""

    weighted_ce: torch.Tensor  # scalar, sum_k w_k * CE_k (differentiable)
    weight: torch.Tensor  # scalar, sum of weights
    correct: torch.Tensor  # [block_size] correct predictions per block position
    counted: torch.Tensor  # [block_size] supervised predictions per block position

    def loss(self) -> torch.Tensor:
        # A batch without a single supervised position has weighted_ce == 0 exactly, so the
        # clamp only avoids 0/0 and yields a zero loss with zero gradients.
        return self.weighted_ce / self.weight.clamp_min(1e-6)


def draft_loss(hidden_BQH: torch.Tensor, lm_head: nn.Module, blocks: DraftBlocks) -> LossStats:
    logits = lm_head(hidden_BQH).float()
    ce = F.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), reduction="none")
    weights = blocks.weights.flatten()
    with torch.no_grad():
        hit = (logits.argmax(-1) == blocks.labels) & blocks.valid
        per_position = (blocks.labels.shape[0], -1, blocks.block_size)
        correct = hit.view(per_position).sum(dim=(0, 1)).float()
        counted = blocks.valid.view(per_position).sum(dim=(0, 1)).float()
    return LossStats(weighted_ce=(ce * weights).sum(), weight=weights.sum(), correct=correct, counted=counted)


def tau_from_accuracy(acc_per_position: list[float]) -> float:
    """tau_sim = 1 + sum_{k>=1} prod_{j=1..k} acc_j (acc_per_position[0] is the anchor, unused)."""
    tau, survive = 1.0, 1.0
    for acc in acc_per_position[1:]:
        if math.isnan(acc):
            break
        survive *= acc
        tau += survive
    return tau
