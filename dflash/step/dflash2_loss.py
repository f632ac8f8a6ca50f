"""DFlash2 loss: DFlash's weighted CE on the unary logits plus alpha x the selector's K-way CE.

Per supervised block position k (it predicts token g = a + k, as in DFlash), with w_k its position
weight, U the unary logits (the target's frozen LM head on the drafter's final hidden state h_k),
C = top-K(U) sorted by U, p the true token before g (ids[a + k - 1]; the anchor for k = 1):
    score_j = U[C_j] + < A[p] * (H h_k), B[C_j] >           (dflash/drafters/dflash2.py)
    CE_k    = -log softmax(U)[g]                              (DFlash's term, full vocabulary)
    gold injection: when g is not in C, the last (weakest) candidate is replaced by g, scored with
                    its own unary logit U[g]; j* = the index of g among the candidates
    SEL_k   = -log softmax_j(score_j)[j*]                     (K-way CE)
    numerator = sum_k w_k (CE_k + alpha SEL_k), divided once by sum_k w_k
The references differ: speculators injects the gold this way and divides by the count of
supervised positions; SpecForge and NeMo drop uncovered positions from the selector term,
SpecForge sharing the backbone's denominator, NeMo its own. The gold injection and the
un-detached unary scores here are vllm-project/speculators' (every supervised position trains
the selector, as the issue states the objective); one denominator for both terms, the
backbone's sum of position weights, is SpecForge's (and what dflash's one-division-per-step
reduction needs, docs/ARCHITECTURE.md §1). The selector's gradient reaches the backbone through
U[C_j] and h_k. Softmax and both CEs in fp32.

Metrics: the standard figures (acc, tau_block, tau_decode) score the drafter's own drafts, the
selector's teacher-forced picks over the strict top-K (g's predecessor true; while a block's
prefix is right these are the greedy walk's picks, so tau_decode predicts decoding with the
selector); beside them the unary argmax's (what DFlash would draft), the oracle the candidates
allow (g in the strict top-K at every position of the prefix), the candidates' recall and mass
(the drafter's own softmax mass on its top-K) and how often the selector changed the unary choice.

Two paths, as for DFlash's CE: the reference (`logits_chunk=0`: every logit through autograd)
and the fused one (labelled rows only, chunk by chunk; the top-K values' and gold logits'
gradients reach the hidden states through K + 1 rows of the frozen head per position).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafters.dflash2 import UNARY_KEYS, DFlash2Drafter
from dflash.step.blocks import DraftBlocks
from dflash.step.loss import LossStats, block_acceptance, chunk_ce_and_grad, fused_head_dtype, labelled_rows
from dflash.torch_runtime.compile import compile_shared


@dataclass
class DFlash2LossStats(LossStats):
    """LossStats (`weighted_ce` holds the whole numerator; correct/accepted/rounds score the
    selector's picks) plus the unary, oracle and candidate sums; device tensors, no host sync."""

    ce: torch.Tensor  # sum_k w_k CE_k (the unary term)
    selector_ce: torch.Tensor  # sum_k w_k SEL_k
    candidate_hits: torch.Tensor  # supervised positions whose label is in the strict top-K
    candidate_mass: torch.Tensor  # sum over supervised positions of softmax(U) mass on the top-K
    selector_changed: torch.Tensor  # supervised positions where the pick is not the unary argmax
    selector_changed_correct: torch.Tensor  # ... and the pick is the label
    unary_correct: torch.Tensor  # [block_size] unary argmax == label
    unary_accepted: torch.Tensor  # leading runs of unary hits (loss.block_acceptance)
    unary_rounds: torch.Tensor
    oracle_accepted: torch.Tensor  # leading runs of positions whose label is in the top-K
    oracle_rounds: torch.Tensor


def _chunk_top_k(logits: torch.Tensor, labels: torch.Tensor, top_k: int) -> tuple[torch.Tensor, ...]:
    """One chunk of rows [n, V]: top-K values and ids (sorted, fp32), the label's own logit and the
    softmax mass on the top-K; no gradient (the caller routes the values' gradients itself)."""
    # Top-K and the gather on the logits as they are (bf16 on GPU: exact in fp32 afterwards), so
    # only the log-sum-exp reads them in fp32 (fused into its reduction when compiled).
    values, ids = torch.topk(logits, top_k, dim=-1)
    values = values.float()
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    mass = torch.exp(values - lse).sum(dim=-1)
    return values, ids, logits.gather(1, labels[:, None]).squeeze(1).float(), mass


@functools.cache
def _compiled_chunk_top_k():
    return compile_shared(_chunk_top_k, dynamic=True)


def _gathered_head_grad(
    grad_rows_NK: torch.Tensor, ids_NK: torch.Tensor, weight_VH: torch.Tensor, chunk: int
) -> torch.Tensor:
    """sum_j grad[n, j] W[ids[n, j]]: the hidden-state gradient of logits gathered at `ids`,
    chunk by chunk ([chunk, K, H] rows of the head at a time)."""
    out = torch.empty(ids_NK.shape[0], weight_VH.shape[1], dtype=weight_VH.dtype, device=weight_VH.device)
    for start in range(0, ids_NK.shape[0], chunk):
        at = slice(start, start + chunk)
        rows = weight_VH.index_select(0, ids_NK[at].flatten()).view(*ids_NK[at].shape, -1)
        out[at] = torch.einsum("nk,nkh->nh", grad_rows_NK[at].to(rows.dtype), rows)
    return out


class _FusedHeadCETopK(torch.autograd.Function):
    """DFlash's fused weighted CE (dflash/step/loss.py `_FusedHeadCE`) that also returns, per
    labelled row, the top-K unary values and ids, the label's logit and the top-K mass. The CE's
    hidden gradient is computed in the forward; the top-K values' and the label logit's, which
    the selector's CE gives only after this returns, in the backward through the K + 1 head rows
    they read. The head is frozen: no weight gradient."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, weights_N, settings):
        chunk, compute_dtype, compiled, top_k = settings
        weight = weight_VH.to(compute_dtype)
        per_chunk = chunk_ce_and_grad(compiled)
        top = _compiled_chunk_top_k() if compiled else _chunk_top_k
        rows = hidden_NH.shape[0]
        grad_hidden = torch.empty_like(hidden_NH)
        weighted_ce = hidden_NH.new_zeros((), dtype=torch.float32)
        hit = torch.empty_like(labels_N, dtype=torch.bool)
        values = hidden_NH.new_empty((rows, top_k), dtype=torch.float32)
        ids = labels_N.new_empty((rows, top_k))
        gold, mass = (hidden_NH.new_empty(rows, dtype=torch.float32) for _ in range(2))
        for start in range(0, rows, chunk):
            at = slice(start, start + chunk)
            logits = hidden_NH[at].to(compute_dtype) @ weight.T
            chunk_ce, hit[at], grad_logits = per_chunk(logits, labels_N[at], weights_N[at])
            values[at], ids[at], gold[at], mass[at] = top(logits, labels_N[at], top_k)
            del logits
            weighted_ce += chunk_ce
            grad_hidden[at] = grad_logits @ weight
        ctx.save_for_backward(grad_hidden, ids, labels_N)
        ctx.weight, ctx.chunk = weight, chunk
        ctx.mark_non_differentiable(hit, ids, mass)
        return weighted_ce, hit, values, ids, gold, mass

    @staticmethod
    def backward(ctx, grad_ce, _grad_hit, grad_values, _grad_ids, grad_gold, _grad_mass):
        grad_hidden, ids, labels = ctx.saved_tensors
        grad = grad_hidden * grad_ce
        if grad_values is not None:
            grad = grad + _gathered_head_grad(grad_values, ids, ctx.weight, ctx.chunk).to(grad.dtype)
        if grad_gold is not None:
            grad = grad + _gathered_head_grad(grad_gold[:, None], labels[:, None], ctx.weight, ctx.chunk).to(
                grad.dtype
            )
        return grad, None, None, None, None


def _labelled_unary(
    hidden_BQH: torch.Tensor,
    *,
    lm_head: nn.Module,
    blocks: DraftBlocks,
    top_k: int,
    chunk: int,
    compiled: bool,
) -> tuple[torch.Tensor, ...]:
    """(sum of w CE over the batch, then per labelled row: unary hit, top-K values, top-K ids,
    the label's logit, the top-K mass)."""

    def labelled(per_position: torch.Tensor) -> torch.Tensor:
        return labelled_rows(per_position, blocks)

    if chunk > 0:
        compute_dtype = fused_head_dtype(hidden_BQH, lm_head)
        with torch.autocast(hidden_BQH.device.type, enabled=False):
            return _FusedHeadCETopK.apply(
                labelled(hidden_BQH),
                lm_head.weight,
                labelled(blocks.labels),
                labelled(blocks.weights),
                (chunk, compute_dtype, compiled, top_k),
            )
    # The reference: every position's logits through autograd.
    logits = lm_head(hidden_BQH).float()
    ce = F.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), reduction="none")
    weighted_ce = (ce * blocks.weights.flatten()).sum()
    rows, labels = labelled(logits), labelled(blocks.labels)
    values, ids = torch.topk(rows, top_k, dim=-1)
    with torch.no_grad():
        mass = torch.softmax(rows, dim=-1).gather(1, ids).sum(dim=-1)
        hit = rows.argmax(dim=-1) == labels
    return weighted_ce, hit, values, ids, rows.gather(1, labels[:, None]).squeeze(1), mass


def _scatter_rows(values_N: torch.Tensor, blocks: DraftBlocks) -> torch.Tensor:
    """Labelled rows' flags back to [B, Q] (False elsewhere)."""
    full = torch.zeros(blocks.valid.numel(), dtype=torch.bool, device=values_N.device)
    return full.index_put_((blocks.loss_rows,), values_N).view_as(blocks.valid)


def dflash2_loss(
    hidden_BQH: torch.Tensor,
    *,
    lm_head: nn.Module,
    drafter: DFlash2Drafter,
    blocks: DraftBlocks,
    selector_alpha: float,
    logits_chunk: int = 0,
    compiled: bool = False,
) -> DFlash2LossStats:
    """The DFlash2 loss statistics of one batch of blocks (built with `with_prev_ids`)."""
    if blocks.prev_ids is None:
        raise ValueError("DFlash2 blocks need prev_ids (build_blocks with with_prev_ids=True)")
    if drafter.settings.keys() & set(UNARY_KEYS):
        raise ValueError(
            "this DFlash2 drafter scales or soft-caps its unary logits (dflash_config.output_multiplier / "
            "final_logit_softcapping); dflash trains drafters without them: decode it, or train a new one"
        )
    selector = drafter.candidate_selector
    top_k = selector.top_k
    weighted_ce, unary_hit, values, ids, gold, mass = _labelled_unary(
        hidden_BQH, lm_head=lm_head, blocks=blocks, top_k=top_k, chunk=logits_chunk, compiled=compiled
    )
    hidden_N = labelled_rows(hidden_BQH, blocks)
    prev_N, labels_N = labelled_rows(blocks.prev_ids, blocks), labelled_rows(blocks.labels, blocks)
    weights_N = labelled_rows(blocks.weights, blocks)
    strict = values + selector.pair_scores(prev_N, hidden_N, ids)  # [n, K]
    gold_score = gold + selector.pair_scores(prev_N, hidden_N, labels_N[:, None])[:, 0]
    is_label = ids == labels_N[:, None]
    covered = is_label.any(dim=-1)
    # Gold injection: an uncovered label takes the last candidate's place, with its own score.
    last = torch.arange(top_k, device=ids.device) == top_k - 1
    inject = ~covered[:, None] & last[None, :]
    scores = torch.where(inject, gold_score[:, None], strict)
    target = torch.where(covered, is_label.float().argmax(dim=-1), top_k - 1)
    selector_ce_N = F.cross_entropy(scores, target, reduction="none")
    selector_ce = (selector_ce_N * weights_N).sum()
    numerator = weighted_ce + selector_alpha * selector_ce
    with torch.no_grad():
        pick = strict.argmax(dim=-1)
        selector_hit = ids.gather(1, pick[:, None]).squeeze(1) == labels_N
        changed = pick != 0  # the candidates are sorted: index 0 is the unary argmax
        per_position = (blocks.labels.shape[0], -1, blocks.block_size)
        valid = blocks.valid.view(per_position)

        def grid(flags_N: torch.Tensor) -> torch.Tensor:
            return _scatter_rows(flags_N, blocks).view(per_position)

        accepted, counted_blocks, rounds = block_acceptance(grid(selector_hit), valid)
        unary_accepted, _, unary_rounds = block_acceptance(grid(unary_hit), valid)
        oracle_accepted, _, oracle_rounds = block_acceptance(grid(covered), valid)
        stats = DFlash2LossStats(
            weighted_ce=numerator,
            weight=blocks.weights.sum(),
            correct=grid(selector_hit).sum(dim=(0, 1)).float(),
            counted=valid.sum(dim=(0, 1)).float(),
            accepted=accepted,
            blocks=counted_blocks,
            rounds=rounds,
            ce=weighted_ce.detach(),
            selector_ce=selector_ce.detach(),
            candidate_hits=covered.sum().float(),
            candidate_mass=mass.sum(),
            selector_changed=changed.sum().float(),
            selector_changed_correct=(changed & selector_hit).sum().float(),
            unary_correct=grid(unary_hit).sum(dim=(0, 1)).float(),
            unary_accepted=unary_accepted,
            unary_rounds=unary_rounds,
            oracle_accepted=oracle_accepted,
            oracle_rounds=oracle_rounds,
        )
    return stats
