"""DFlash loss: gamma-weighted cross-entropy, unweighted per-position accuracy, tau_sim.

`BlockLoss` is the config group `loss`'s component: the position weights blocks are scored with
and how the fused LM-head loss is chunked. A subclass may weigh positions otherwise (an
ablation); position 0, the given anchor, never carries loss whatever it returns.

The loss is reduced as (sum of w * CE, sum of w) and divided once by whoever owns the whole
step: with several replicas or accumulation, a replica that drew short or empty batches must
not weigh as much as one that drew full ones (docs/ARCHITECTURE.md §1).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.step.blocks import DraftBlocks, position_weights
from dflash.torch_runtime.compile import compile_shared

if TYPE_CHECKING:  # the variants' losses build on this module's: they import it
    from dflash.step.variant import DFlashVariant


@dataclass(frozen=True)
class BlockLoss:
    """loss.gamma: w_k = exp(-(k - 1) / gamma) for block position k >= 1 (paper: 7 for B=16, 5
    for B=10, 4 for B=8). loss.logits_chunk: labelled block positions per chunk of the fused
    LM-head loss (0: the reference, all logits through autograd)."""

    gamma: float
    logits_chunk: int = 0

    def position_weights(self, block_size: int, label_offset: int = 0) -> torch.Tensor:
        """[block_size] weights; a position that predicts no token (DFlash's position 0, the
        anchor) is never scored. label_offset: the variant's (dflash/step/variant.py)."""
        return position_weights(block_size, self.gamma, label_offset)

    def weigh(self, hidden_BQH: torch.Tensor, lm_head: nn.Module, blocks: DraftBlocks) -> DraftBlocks:
        """The blocks as the loss scores them, once the drafter's hidden states exist: these
        static weights as they are; a loss whose weights follow the drafter's own predictions
        replaces them (loss=dpace, dflash/step/dpace.py)."""
        return blocks


@dataclass
class LossStats:
    """Device tensors; nothing here syncs with the host."""

    weighted_ce: torch.Tensor  # scalar, sum_k w_k * CE_k (differentiable)
    weight: torch.Tensor  # scalar, sum of weights
    correct: torch.Tensor  # [block_size] correct predictions per block position
    counted: torch.Tensor  # [block_size] supervised predictions per block position
    accepted: torch.Tensor  # scalar, sum over blocks of the leading run of correct predictions
    blocks: torch.Tensor  # scalar, blocks whose first prediction is supervised
    rounds: torch.Tensor  # scalar, sum over those blocks of 1 / (1 + leading run): see block_acceptance

    def loss(self) -> torch.Tensor:
        # A batch without a single supervised position has weighted_ce == 0 exactly, so the
        # clamp only avoids 0/0 and yields a zero loss with zero gradients.
        return self.weighted_ce / self.weight.clamp_min(1e-6)


def _weighted_ce_and_hits(
    hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: full-vocab logits through autograd (kept for tests and `logits_chunk=0`)."""
    logits = lm_head(hidden).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & valid
    return (ce * weights.flatten()).sum(), hit


def _chunk_ce_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of logits [n, V] of labelled positions -> (sum of w * CE, hits [n],
    d(sum w * CE)/d(logits) in the logits' dtype). Softmax and CE in fp32, as the reference's `.float()` does. Compiled on
    CUDA (drafter.compile): one fused pass over the chunk instead of one per elementwise op."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    w = weights[:, None]
    weighted_ce = ((lse - x.gather(1, labels[:, None])) * w).sum()
    hit = x.argmax(dim=-1) == labels
    # d(w * CE)/d(logits) = w * (softmax - onehot). The one-hot is a comparison with the column
    # index rather than a scatter so that the compiled chunk can be one elementwise epilogue that
    # writes the gradient in the logits' dtype: with the scatter, an H200 profile of the SmolLM2
    # step showed a separate vocab-wide cast kernel (11 ms per step; not measured alone since:
    # the chain's training went 143 -> 161 samples/s with this and `loss_rows` together). Same
    # fp32 arithmetic (p*w - w at the label): the same bits as the scatter.
    p_w = torch.exp(x - lse) * w
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    grad = torch.where(onehot, p_w - w, p_w)
    return weighted_ce, hit, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk_ce_and_grad():
    return compile_shared(_chunk_ce_and_grad, dynamic=True)


def chunk_ce_and_grad(compiled: bool):
    """The fused loss's per-chunk function (logits, labels, weights) -> (sum of w * CE, hits,
    d/d(logits)), compiled on request: the fused losses built on DFlash's CE share it."""
    return _compiled_chunk_ce_and_grad() if compiled else _chunk_ce_and_grad


class _FusedHeadCE(torch.autograd.Function):
    """sum_n w_n * CE(hidden_n @ W^T, label_n), chunk by chunk, with d/d(hidden) computed in the
    forward pass: each chunk's logits live only while that chunk is processed, and the LM head
    runs twice per position (logits, then the hidden gradient) instead of the three times of a
    checkpointed chunk (logits, recomputed logits, hidden gradient). The head is frozen, so no
    weight gradient is ever needed. Numerics follow the reference under autocast: the matmuls in
    `compute_dtype`, softmax and CE in fp32.

    Written here rather than taken from a kernel library because none was usable where we train:
    the GPU image has torch 2.11 (torch's own `F.linear_cross_entropy` arrives in 2.13) and no
    Liger. A replacement needs per-position weights (reduction="none") and each position's argmax
    (the accuracy behind tau_sim); tests/test_dflash_rules.py holds any of them to the reference.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, weights_N, chunk, compute_dtype, compiled):
        weight = weight_VH.to(compute_dtype)
        per_chunk = chunk_ce_and_grad(compiled)
        grad_hidden = torch.empty_like(hidden_NH)
        weighted_ce = hidden_NH.new_zeros((), dtype=torch.float32)
        hit = torch.empty_like(labels_N, dtype=torch.bool)
        for start in range(0, hidden_NH.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = hidden_NH[rows].to(compute_dtype) @ weight.T
            chunk_ce, hit[rows], grad_logits = per_chunk(logits, labels_N[rows], weights_N[rows])
            del logits
            weighted_ce += chunk_ce
            grad_hidden[rows] = grad_logits @ weight
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(hit)
        return weighted_ce, hit

    @staticmethod
    def backward(ctx, grad_weighted_ce, _grad_hit):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_weighted_ce, None, None, None, None, None, None


def fused_head_dtype(hidden_BQH: torch.Tensor, lm_head: nn.Module) -> torch.dtype:
    """The dtype a fused LM-head loss multiplies in (autocast's, else the promoted one), after
    refusing a head it cannot serve: its gradient and bias are never computed."""
    if getattr(lm_head, "bias", None) is not None or lm_head.weight.requires_grad:
        raise ValueError("the fused LM-head loss needs a frozen, bias-free LM head (set loss.logits_chunk=0)")
    device_type = hidden_BQH.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden_BQH.dtype, lm_head.weight.dtype)


def labelled_rows(per_position: torch.Tensor, blocks: DraftBlocks) -> torch.Tensor:
    """[B, Q, ...] -> the rows of `blocks.loss_rows`, [n, ...].

    Only positions with a label go through the LM head (`loss_rows`, found on the host): the
    others carry weight 0, no gradient and never a hit. That skips block position 0 for DFlash
    (the anchor itself: 1/block_size of the loss's two vocab-wide matmuls, the largest GEMMs of a
    paper-scale step) and, on conversations, padding blocks and positions past a sample's end or
    outside its replies (15% of the rows of the SmolLM2 chain's batches)."""
    return per_position.flatten(0, 1).index_select(0, blocks.loss_rows)


def _fused_weighted_ce_and_hits(
    hidden_BQH: torch.Tensor, lm_head: nn.Module, blocks: DraftBlocks, chunk: int, compiled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    compute_dtype = fused_head_dtype(hidden_BQH, lm_head)
    device_type, rows = hidden_BQH.device.type, blocks.loss_rows

    def labelled(per_position: torch.Tensor) -> torch.Tensor:
        return labelled_rows(per_position, blocks)

    with torch.autocast(device_type, enabled=False):
        weighted_ce, hit_rows = _FusedHeadCE.apply(
            labelled(hidden_BQH),
            lm_head.weight,
            labelled(blocks.labels),
            labelled(blocks.weights),
            chunk,
            compute_dtype,
            compiled,
        )
    hit = torch.zeros_like(blocks.valid).flatten().index_put_((rows,), hit_rows)  # rows are unique
    return weighted_ce, hit.view_as(blocks.valid)


def draft_loss(
    hidden_BQH: torch.Tensor,
    lm_head: nn.Module,
    blocks: DraftBlocks,
    logits_chunk: int = 0,
    *,
    compiled: bool = False,
) -> LossStats:
    """Loss statistics of one batch of blocks.

    logits_chunk > 0 (the default config): the fused path, at most that many block positions
    (over the whole batch) through the LM head at a time; the [B, Q, vocab] logits never exist at
    once. At paper scale (512 anchors x 16 positions x a 151k vocab) they would take ~5 GB per
    sample. logits_chunk = 0: the reference path, all logits at once through autograd.
    compiled: the fused path's per-chunk softmax/CE/gradient through torch.compile.
    """
    if logits_chunk > 0:
        weighted_ce, hit = _fused_weighted_ce_and_hits(hidden_BQH, lm_head, blocks, logits_chunk, compiled)
    else:
        weighted_ce, hit = _weighted_ce_and_hits(
            hidden_BQH, lm_head, blocks.labels, blocks.weights, blocks.valid
        )
    with torch.no_grad():
        per_position = (blocks.labels.shape[0], -1, blocks.block_size)
        correct = hit.view(per_position).sum(dim=(0, 1)).float()
        counted = blocks.valid.view(per_position).sum(dim=(0, 1)).float()
        accepted, counted_blocks, rounds = block_acceptance(
            hit.view(per_position), blocks.valid.view(per_position)
        )
    return LossStats(
        weighted_ce=weighted_ce,
        weight=blocks.weights.sum(),
        correct=correct,
        counted=counted,
        accepted=accepted,
        blocks=counted_blocks,
        rounds=rounds,
    )


def block_acceptance(
    hit_BAK: torch.Tensor, valid_BAK: torch.Tensor, first: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum over blocks of the leading run of correct predictions, number of blocks, sum over
    blocks of 1 / (1 + run)), for blocks whose first prediction is supervised. Greedy
    verification accepts exactly that run, so 1 + run is what a round anchored there produces:
    unlike tau_sim (a product of per-position accuracies, as if positions were independent) it
    keeps how a block's hits go together. A block cut by the end of its sample ends its run
    there, and so does a position noise=mask_ramp kept unmasked (it carries no label):
    train/tau_block reads low under that noise; validation draws no kept positions.

    The third sum is for `tau_from_rounds`: anchors sit at positions drawn uniformly, but a
    decoder anchors each round where the last one ended, so it crosses an easy stretch (long
    runs) in few rounds and spends most of its rounds in hard stretches.

    `first`: the first block position that predicts (DFlash: 1, position 0 is the anchor;
    DSpark: 0, dflash/step/variant.py)."""
    run = hit_BAK[:, :, first:].to(torch.int32).cumprod(dim=2).sum(dim=2)
    counted = valid_BAK[:, :, first].float()
    return (run * counted).sum().float(), counted.sum(), (counted / (1 + run)).sum()


def share(value: float, total: float) -> float:
    """value / total of a window's sums; nan where the window counted nothing (total 0)."""
    return value / total if total > 0 else float("nan")


def tau_from_runs(accepted: float, blocks: float) -> float:
    """tau_block = 1 + the mean leading run of correct predictions (see `block_acceptance`)."""
    return 1.0 + share(accepted, blocks)


def tau_from_rounds(blocks: float, rounds: float) -> float:
    """tau_decode = blocks / sum of 1 / (1 + run): the harmonic mean of what a round anchored at
    each sampled position produces. Where that length L changes slowly along a sequence, a
    decoder walking it spends 1 / L rounds per token, so tokens / rounds is this harmonic mean;
    tau_block, the arithmetic mean, weighs easy stretches as much as hard ones and reads high
    whenever acceptance varies along the text (see `block_acceptance`)."""
    return share(blocks, rounds)


def tau_from_accuracy(acc_per_position: list[float]) -> float:
    """tau_sim = 1 + sum_{k>=1} prod_{j=1..k} acc_j (acc_per_position[0] is the anchor, unused)."""
    tau, survive = 1.0, 1.0
    for acc in acc_per_position[1:]:
        if math.isnan(acc):
            break
        survive *= acc
        tau += survive
    return tau


def objective_figures(sums: Mapping[str, Any], variant: DFlashVariant | None = None) -> dict[str, float]:
    """loss, acc, tau_sim, tau_block, tau_decode and acc_pos_k from summed `LossStats` fields
    (host floats; `correct` and `counted` per block position), each divided once over the whole
    sum: a batch or replica with few supervised positions weighs what it holds. Training
    (train/, per log window) and the held-out split (val/) both report these, then the figures
    of the run's `variant` (dflash/step/variant.py: `figures`, from the sums it added; None:
    plain DFlash, none)."""
    correct, counted = sums["correct"], sums["counted"]
    acc = [share(c, n) for c, n in zip(correct, counted)]
    figures = {
        "loss": sums["weighted_ce"] / sums["weight"] if sums["weight"] > 0 else 0.0,
        "acc": sum(correct[1:]) / max(1.0, sum(counted[1:])),
        "tau_sim": tau_from_accuracy(acc),
        "tau_block": tau_from_runs(sums["accepted"], sums["blocks"]),
        "tau_decode": tau_from_rounds(sums["blocks"], sums["rounds"]),
        **{f"acc_pos_{k}": acc[k] for k in range(1, len(acc))},
    }
    if variant is not None:
        figures.update(variant.figures(sums))
    return figures


# The figures every variant reports for a held-out split (each variant adds its own
# `figure_names`, dflash/step/variant.py).
VAL_FIGURES = ("loss", "acc", "tau_sim", "tau_block", "tau_decode")
