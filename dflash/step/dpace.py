"""D-PACE (`loss=dpace`): position weights from the drafter's own confidence, for DFlash and DFlash2.

The rule (D-PACE, arXiv 2605.18810, Eqs. 7-9; as NVIDIA/Model-Optimizer's `dflash_loss_objective:
dpace`, SpecForge's `--loss-type dpace` and vllm-project/speculators' `dpace` weighting compute it),
per block, over its supervised positions k in order:
    q_k  = softmax(lm_head(h_k))[label_k]        the drafter's probability of the true token
    s_k  = alpha + (1 - alpha) q_k                smoothed toward 1, so no weight reaches 0
    C_k  = prod_{i <= k} s_i                      the chance the draft survives to position k
    w_k  = sum_{m >= k} C_m                       C_k times the accepted length still ahead of k
A position without a label (the anchor slot, past the sample's end, outside the replies) is 1
in the products and 0 in the sums. The weights are detached: they say where the loss spends its
gradient and add none of their own. The loss is then DFlash's, sum_k w_k CE_k / sum_k w_k, with
the same one division per step; DFlash2's selector term shares the weights, as it shares the
decay's (dflash/step/dflash2_loss.py; ModelOpt leaves its selector term unweighted). The static
decay and its `loss.gamma` are not used: a drafter option still sets `loss.gamma` for its block
size, and under `loss=dpace` nothing reads it.

Why a separate pass for q: the fused LM-head loss computes its gradient in the forward pass with
the weights in hand (dflash/step/loss.py), and D-PACE's weight of position k depends on the
confidences of the positions after it. So the labelled rows go through the LM head once more,
without autograd, chunk by chunk (one more forward matmul per labelled row).

Not for DSpark or LiLiCorr: their references (DeepSpec and ModelOpt's dspark.yaml; ModelOpt's
lilicorr.yaml) train with the static decay only; `loss=dpace` with either is refused before any
weights load, by the variant's own `run_refusal`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dflash.step.blocks import DraftBlocks
from dflash.step.loss import BlockLoss, labelled_rows


def dpace_weights(confidence_BAK: torch.Tensor, valid_BAK: torch.Tensor, alpha: float) -> torch.Tensor:
    """[..., K] D-PACE weights of each block's positions from their confidences q (any value where
    not valid) and the supervised positions; 0 where not valid."""
    smoothed = alpha + (1.0 - alpha) * confidence_BAK.float()
    survive = torch.cumprod(torch.where(valid_BAK, smoothed, torch.ones_like(smoothed)), dim=-1)
    survive = survive * valid_BAK
    # Suffix sums as the total minus the sums before k: one cumsum, no flip.
    running = torch.cumsum(survive, dim=-1)
    return (running[..., -1:] - running + survive) * valid_BAK


@torch.no_grad()
def label_probability(
    hidden_BQH: torch.Tensor, lm_head: nn.Module, blocks: DraftBlocks, chunk: int
) -> torch.Tensor:
    """[B, Q] the drafter's probability of each supervised label (0 elsewhere), through the LM
    head `chunk` labelled rows at a time (0: all at once). Softmax in fp32."""
    hidden_N, labels_N = labelled_rows(hidden_BQH, blocks), labelled_rows(blocks.labels, blocks)
    probability_N = hidden_N.new_empty(labels_N.shape, dtype=torch.float32)
    step = chunk if chunk > 0 else max(1, labels_N.shape[0])
    for start in range(0, labels_N.shape[0], step):
        rows = slice(start, start + step)
        logits = lm_head(hidden_N[rows]).float()
        label_logit = logits.gather(1, labels_N[rows, None]).squeeze(1)
        probability_N[rows] = torch.exp(label_logit - torch.logsumexp(logits, dim=-1))
    full = torch.zeros(blocks.labels.numel(), dtype=torch.float32, device=hidden_BQH.device)
    return full.index_put_((blocks.loss_rows,), probability_N).view_as(blocks.labels)


@dataclass(frozen=True)
class DPaceLoss(BlockLoss):
    """loss=dpace: `alpha` (0 < alpha <= 1, the references' 0.5) smooths the confidences;
    `gamma` is kept for the drafter options that set it and ignored."""

    alpha: float = 0.5

    def position_weights(self, block_size: int, label_offset: int = 0) -> torch.Tensor:
        # The blocks' static weights only mark the supervised positions: `weigh` replaces them.
        return super().position_weights(block_size, label_offset).gt(0).float()

    def weigh(self, hidden_BQH: torch.Tensor, lm_head: nn.Module, blocks: DraftBlocks) -> DraftBlocks:
        probability = label_probability(hidden_BQH, lm_head, blocks, self.logits_chunk)
        per_block = (blocks.labels.shape[0], -1, blocks.block_size)
        weights = dpace_weights(probability.view(per_block), blocks.valid.view(per_block), self.alpha)
        return dataclasses.replace(blocks, weights=weights.view_as(blocks.weights).to(blocks.weights.dtype))
