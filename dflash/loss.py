"""DFlash loss: gamma-weighted cross-entropy, unweighted per-position accuracy, tau_sim.

The loss is reduced as (sum of w * CE, sum of w) and divided once by whoever owns the whole
step: with several replicas or accumulation, a replica that drew short or empty batches must
not weigh as much as one that drew full ones (docs/ARCHITECTURE.md §1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

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


def _weighted_ce_and_hits(
    hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
    return (ce * weights.flatten()).sum(), hit


def draft_loss(
    hidden_BQH: torch.Tensor, lm_head: nn.Module, blocks: DraftBlocks, logits_chunk: int = 0
) -> LossStats:
    """Loss statistics of one batch of blocks.

    logits_chunk > 0 projects at most that many block positions per sample through the LM head
    at a time and recomputes each chunk's logits in backward (activation checkpointing): the
    [B, Q, vocab] float logits never exist at once. At paper scale (512 anchors x 16 positions x
    a 151k vocab) they would take ~5 GB per sample.
    """
    q_len = hidden_BQH.shape[1]
    if logits_chunk <= 0 or logits_chunk >= q_len:
        weighted_ce, hit = _weighted_ce_and_hits(
            hidden_BQH, lm_head, blocks.labels, blocks.weights, blocks.valid
        )
    else:
        weighted_ce, hits = hidden_BQH.new_zeros((), dtype=torch.float32), []
        for start in range(0, q_len, logits_chunk):
            part = slice(start, start + logits_chunk)
            chunk_ce, chunk_hit = checkpoint(
                _weighted_ce_and_hits,
                hidden_BQH[:, part],
                lm_head,
                blocks.labels[:, part],
                blocks.weights[:, part],
                blocks.valid[:, part],
                use_reentrant=False,
            )
            weighted_ce = weighted_ce + chunk_ce
            hits.append(chunk_hit)
        hit = torch.cat(hits, dim=1)
    with torch.no_grad():
        per_position = (blocks.labels.shape[0], -1, blocks.block_size)
        correct = hit.view(per_position).sum(dim=(0, 1)).float()
        counted = blocks.valid.view(per_position).sum(dim=(0, 1)).float()
    return LossStats(weighted_ce=weighted_ce, weight=blocks.weights.sum(), correct=correct, counted=counted)


def tau_from_accuracy(acc_per_position: list[float]) -> float:
    """tau_sim = 1 + sum_{k>=1} prod_{j=1..k} acc_j (acc_per_position[0] is the anchor, unused)."""
    tau, survive = 1.0, 1.0
    for acc in acc_per_position[1:]:
        if math.isnan(acc):
            break
        survive *= acc
        tau += survive
    return tau
