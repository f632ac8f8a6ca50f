"""DSpark loss: CE + distance to the target's distribution + the confidence head's BCE.

Per supervised block position k (it predicts token a + k + 1; dflash/step/variant.py), with
w_k its position weight, z_k the draft logits (the target's frozen LM head on the drafter's
hidden state, plus the Markov bias of the true previous token), t_k the target's logits for the
same token (its LM head on its own final hidden state at position a + k), p = softmax(z_k),
q = softmax(t_k), c_k the confidence head's logit:
    CE_k   = -log p[label_k]
    L1_k   = sum_v |p_v - q_v|                      (twice the total variation distance)
    acc_k  = clamp(1 - L1_k / 2, 0, 1)              (the soft acceptance: 1 - TV)
    BCE_k  = BCE_with_logits(c_k, stop_gradient(acc_k))
    numerator = sum_k w_k (ce_weight CE_k + tv_weight L1_k + confidence_weight BCE_k)
as deepseek-ai/DeepSpec `deepspec/modeling/dspark/loss.py` computes it (its three terms share
one denominator, sum_k w_k, so the weighted sum of its per-term means is this numerator over it).
The numerator is reduced like DFlash's (sum of numerators, sum of weights, one division per
optimizer step: docs/ARCHITECTURE.md §1). Softmax and every term in fp32; no temperature.

Two paths, as for DFlash's CE: the reference (`logits_chunk=0`: every logit through autograd)
and the fused one (labelled rows only, chunk by chunk, each chunk's gradients computed in the
forward; the [rows, vocab] logits of draft and target never exist at once). The fused path's
vocabulary-wide terms run as the PyTorch formula (`_chunk_terms_and_grads`, compiled with the
drafter) or as one Triton kernel (`variant.fused_terms=triton`, dflash/step/dspark_kernel.py).

Metrics: `acc_pos_j` and the taus count the anchor slot's prediction as the first draft; the
confidence head's calibration beside the mean `acc` of each draft. The top-1 `acc` is
teacher-forced: each position's Markov bias reads the true previous token, also after a miss,
where a decoder would have drafted another prefix; so it reads higher than DFlash's (SmolLM2,
800 steps: val/acc 0.363 vs 0.210) while the taus, which stop at a block's first miss, are what
compares across variants (val/tau_decode 1.400 vs 1.457).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config.schema import FusedTerms
from dflash.drafters.dspark import DSparkDrafter
from dflash.step.blocks import DraftBlocks
from dflash.step.loss import LossStats, block_acceptance, fused_head_dtype, labelled_rows
from dflash.torch_runtime.compile import compile_shared
from dflash.torch_runtime.kernel_libraries import triton_runs


@dataclass(frozen=True)
class DSparkWeights:
    """The three terms' weights (reference defaults 0.1, 0.9, 1.0)."""

    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0


@dataclass
class DSparkLossStats(LossStats):
    """LossStats (`weighted_ce` holds the whole DSpark numerator, the tensor to differentiate)
    plus each term and the target-probability figures; device tensors, no host sync.
    Per-position vectors are [block_size], position k predicting token a + k + 1."""

    ce: torch.Tensor  # sum_k w_k CE_k
    l1: torch.Tensor  # sum_k w_k L1_k
    confidence_loss: torch.Tensor  # sum_k w_k BCE_k (0 without a confidence head)
    soft_accepted: torch.Tensor  # [block_size] sum of acc_k over supervised positions
    prob_accepted: torch.Tensor  # sum over blocks of sum_k prod_{j<=k} acc_j (expected accepted drafts)
    confidence_abs_error: torch.Tensor  # sum_k w_k |sigmoid(c_k) - acc_k|
    confidence_bias: torch.Tensor  # sum_k w_k (sigmoid(c_k) - acc_k)
    confidence_cumprod_bias: torch.Tensor  # sum_k w_k (prod_{j<=k} sigmoid(c_j) - prod_{j<=k} acc_j)
    confidence_predicted: torch.Tensor  # [block_size] sum of sigmoid(c_k) over supervised positions


class _Batch(NamedTuple):
    """A batch's inputs to the per-row terms: the drafter's hidden states at the block
    positions, the target's LM head, the drafter, the blocks, the target's final hidden states
    and the Markov head's latents (None without one)."""

    hidden_BQH: torch.Tensor
    lm_head: nn.Module
    drafter: DSparkDrafter
    blocks: DraftBlocks
    final_BSH: torch.Tensor
    latent_BQR: torch.Tensor | None


def _terms(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: CE, L1, soft acceptance and argmax hit from [n, V] logits (fp32 inside)."""
    z, t = draft_logits.float(), target_logits.float()
    ce = F.cross_entropy(z, labels, reduction="none")
    l1 = (torch.softmax(z, dim=-1) - torch.softmax(t, dim=-1)).abs().sum(dim=-1)
    acc = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    return ce, l1, acc, z.argmax(dim=-1) == labels


def _markov_bias(drafter: DSparkDrafter, latent: torch.Tensor | None) -> torch.Tensor | int:
    if latent is None:
        return 0
    return drafter.markov_head.bias(latent)


def _reference_rows(batch: _Batch) -> tuple[torch.Tensor, ...]:
    """The reference: every position's draft and target logits through autograd."""
    hidden_BQH, lm_head, drafter, blocks, final_BSH, latent_BQR = batch
    draft_logits = lm_head(hidden_BQH) + _markov_bias(drafter, latent_BQR)
    bsz, seq_len, _ = final_BSH.shape
    gather = blocks.positions.clamp(max=seq_len - 1)  # positions past a sample's end carry no weight
    target_BQH = torch.gather(final_BSH, 1, gather[:, :, None].expand(-1, -1, final_BSH.shape[-1]))
    with torch.no_grad():
        target_logits = lm_head(target_BQH.to(lm_head.weight.dtype))
    ce, l1, acc, hit = _terms(
        draft_logits.flatten(0, 1), target_logits.flatten(0, 1), blocks.labels.flatten()
    )
    return ce, l1, acc, hit & blocks.valid.flatten()


def _chunk_terms_and_grads(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    target_rows: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    ce_weight: float,
    tv_weight: float,
) -> tuple[torch.Tensor, ...]:
    """One chunk of rows: (CE, L1, acc, hit) per row and d(sum w (ce_weight CE + tv_weight L1))/dz
    in the logits' dtype; row n's target logits are `target_logits[target_rows[n]]` (rows whose
    blocks overlap share a position). With s = sign(p - q): dL1/dz_j = p_j (s_j - sum_v s_v p_v);
    dCE/dz = p - onehot. fp32 throughout, as the reference's `.float()`."""
    z, t = draft_logits.float(), target_logits[target_rows].float()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    q = torch.softmax(t, dim=-1)
    diff = p - q
    l1 = diff.abs().sum(dim=-1)
    ce = lse.squeeze(-1) - z.gather(1, labels[:, None]).squeeze(-1)
    sign = torch.sign(diff)
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == labels[:, None]
    w = weights[:, None]
    grad = w * (ce_weight * (p - onehot.float()) + tv_weight * p * (sign - (sign * p).sum(-1, keepdim=True)))
    acc = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    return ce, l1, acc, z.argmax(dim=-1) == labels, grad.to(draft_logits.dtype)


def _accumulate_w2_grad(
    grad_w2_VR: torch.Tensor, grad_logits_NV: torch.Tensor, latent_NR: torch.Tensor
) -> None:
    """grad_w2 += grad_logits^T @ latent, summed in fp32 over the chunks. Both factors hold
    low-precision values (the logits' dtype), so on CUDA one low-precision GEMM with fp32
    output computes the same products and fp32 sums as an fp32 GEMM of their upcasts, on the
    tensor cores instead of the CUDA cores (at the paper's shape, up to 8,192 labelled rows x 151,936
    x rank 256: 0.6 TFLOP per step); elsewhere the fp32 GEMM."""
    if grad_logits_NV.is_cuda and grad_logits_NV.dtype in (torch.bfloat16, torch.float16):
        grad_w2_VR += torch.mm(grad_logits_NV.T, latent_NR, out_dtype=torch.float32)
    else:
        grad_w2_VR += grad_logits_NV.float().T @ latent_NR.float()


@functools.cache
def _compiled_chunk_terms_and_grads():
    return compile_shared(_chunk_terms_and_grads, dynamic=True)


def resolve_fused_terms(fused_terms: FusedTerms, device: torch.device) -> FusedTerms:
    """`auto`: the Triton kernel on CUDA where triton is installed, the PyTorch formula elsewhere."""
    if fused_terms is not FusedTerms.auto:
        return fused_terms
    return FusedTerms.triton if triton_runs(device) else FusedTerms.inductor


def chunk_terms_function(fused_terms: FusedTerms, compiled: bool):
    """The per-chunk function of `_chunk_terms_and_grads`'s contract that `fused_terms` names."""
    if fused_terms is FusedTerms.triton:
        from dflash.step.dspark_kernel import chunk_terms_and_grads  # triton: the gpu extra

        return chunk_terms_and_grads
    return _compiled_chunk_terms_and_grads() if compiled else _chunk_terms_and_grads


class _FusedDSparkHead(torch.autograd.Function):
    """sum_n w_n (ce_weight CE_n + tv_weight L1_n) over labelled rows, chunk by chunk, with the
    gradients of the draft hidden states, the Markov latents and `markov_w2` computed in the
    forward (as dflash/step/loss.py's `_FusedHeadCE` does for CE): the draft logits are
    hidden @ W^T + latent @ W2^T, the target's t @ W^T; W (the target's LM head) is frozen.
    Also returns per row (no gradient): CE, L1, the soft acceptance and the argmax hit."""

    @staticmethod
    def forward(
        ctx, hidden_NH, latent_NR, w2_VR, target_UH, target_index_N, weight_VH, labels_N, weights_N, settings
    ):
        chunk, spans, compute_dtype, per_chunk, ce_weight, tv_weight = settings
        weight = weight_VH.to(compute_dtype)
        w2 = None if w2_VR is None else w2_VR.to(compute_dtype)
        rows = hidden_NH.shape[0]
        grad_hidden = torch.empty_like(hidden_NH)
        grad_latent = None if latent_NR is None else torch.empty_like(latent_NR)
        grad_w2 = None if w2_VR is None else torch.zeros_like(w2_VR, dtype=torch.float32)
        objective = hidden_NH.new_zeros((), dtype=torch.float32)
        ce, l1, acc = (hidden_NH.new_empty(rows, dtype=torch.float32) for _ in range(3))
        hit = torch.empty_like(labels_N, dtype=torch.bool)
        for start, (low, high) in zip(range(0, rows, chunk), spans):
            at = slice(start, start + chunk)
            logits = hidden_NH[at].to(compute_dtype) @ weight.T
            if w2 is not None:
                logits = logits + latent_NR[at].to(compute_dtype) @ w2.T
            # The target's logits once per position of the chunk's span (its rows' blocks overlap:
            # at the paper's shape, 512 anchors of block 16 over 3,072 tokens, 8,185 labelled rows
            # read 2,882 distinct positions, and the four 2,048-row chunks' spans hold 2,902).
            target_logits = target_UH[low:high].to(compute_dtype) @ weight.T
            ce[at], l1[at], acc[at], hit[at], grad_logits = per_chunk(
                logits,
                target_logits,
                target_index_N[at] - low,
                labels_N[at],
                weights_N[at],
                ce_weight,
                tv_weight,
            )
            del logits, target_logits
            objective += (weights_N[at] * (ce_weight * ce[at] + tv_weight * l1[at])).sum()
            grad_hidden[at] = grad_logits @ weight
            if w2 is not None:
                grad_latent[at] = grad_logits @ w2
                _accumulate_w2_grad(grad_w2, grad_logits, latent_NR[at].to(grad_logits.dtype))
        ctx.save_for_backward(grad_hidden, grad_latent, grad_w2)
        ctx.w2_dtype = None if w2_VR is None else w2_VR.dtype
        ctx.mark_non_differentiable(ce, l1, acc, hit)
        return objective, ce, l1, acc, hit

    @staticmethod
    def backward(ctx, grad_objective, *_unused):
        grad_hidden, grad_latent, grad_w2 = ctx.saved_tensors
        grad_hidden, grad_latent, grad_w2 = (
            None if g is None else g * grad_objective for g in (grad_hidden, grad_latent, grad_w2)
        )
        if grad_w2 is not None:
            grad_w2 = grad_w2.to(ctx.w2_dtype)  # accumulated in fp32 over the chunks
        return grad_hidden, grad_latent, grad_w2, None, None, None, None, None, None


def _fused_rows(batch: _Batch, *, weights: DSparkWeights, chunk: int, per_chunk) -> tuple[torch.Tensor, ...]:
    """The fused path over `blocks.loss_rows` only, each chunk's terms by `per_chunk`; returns
    (numerator of the CE and L1 terms, then CE, L1, acc, hit per labelled row)."""
    hidden_BQH, lm_head, drafter, blocks, final_BSH, latent_BQR = batch
    compute_dtype = fused_head_dtype(hidden_BQH, lm_head)
    device_type = hidden_BQH.device.type

    def labelled(per_position: torch.Tensor) -> torch.Tensor:
        return labelled_rows(per_position, blocks)

    # The target's final state at the labelled rows' own positions, each distinct position once
    # (found on the host with the blocks): only those cross the LM head. Each chunk of rows reads
    # a span of them, also found on the host.
    target_UH = final_BSH.flatten(0, 1).index_select(0, blocks.final_positions)
    index = blocks.final_index_host
    spans = [
        (int(index[start : start + chunk].min()), int(index[start : start + chunk].max()) + 1)
        for start in range(0, len(index), chunk)
    ]
    w2 = None if latent_BQR is None else drafter.markov_head.markov_w2.weight
    with torch.autocast(device_type, enabled=False):
        return _FusedDSparkHead.apply(
            labelled(hidden_BQH),
            None if latent_BQR is None else labelled(latent_BQR),
            w2,
            target_UH,
            blocks.final_index,
            lm_head.weight,
            labelled(blocks.labels),
            labelled(blocks.weights),
            (chunk, spans, compute_dtype, per_chunk, weights.ce, weights.tv),
        )


def _scatter_rows(values_N: torch.Tensor, blocks: DraftBlocks, fill: float | bool) -> torch.Tensor:
    """Labelled rows back to [B, Q] (`fill` elsewhere)."""
    full = torch.full(blocks.valid.shape, fill, dtype=values_N.dtype, device=values_N.device).flatten()
    return full.index_put_((blocks.loss_rows,), values_N).view_as(blocks.valid)


def _weighted_terms(
    batch: _Batch, *, weights: DSparkWeights, logits_chunk: int, per_chunk
) -> tuple[torch.Tensor, ...]:
    """(the CE and L1 terms' numerator, sum_k w_k CE_k, sum_k w_k L1_k, the soft acceptance and
    the argmax hit [B, Q]) by the fused path (`logits_chunk` > 0, each chunk by `per_chunk`) or
    the reference."""
    w = batch.blocks.weights
    if logits_chunk > 0:
        objective, ce_n, l1_n, acc_n, hit_n = _fused_rows(
            batch, weights=weights, chunk=logits_chunk, per_chunk=per_chunk
        )
        labelled_w = w.flatten().index_select(0, batch.blocks.loss_rows)
        acc = _scatter_rows(acc_n, batch.blocks, 0.0)
        hit = _scatter_rows(hit_n, batch.blocks, False)
        return objective, (ce_n * labelled_w).sum(), (l1_n * labelled_w).sum(), acc, hit
    ce, l1, acc_flat, hit_flat = _reference_rows(batch)
    ce_sum, l1_sum = (ce * w.flatten()).sum(), (l1 * w.flatten()).sum()
    objective = weights.ce * ce_sum + weights.tv * l1_sum
    return objective, ce_sum, l1_sum, acc_flat.view_as(w).detach(), hit_flat.view_as(w)


class _ConfidenceTerms(NamedTuple):
    """The confidence head's BCE numerator and its figures (zeros without a head)."""

    logits: torch.Tensor | None
    loss: torch.Tensor
    abs_error: torch.Tensor
    bias: torch.Tensor
    cumprod_bias: torch.Tensor
    predicted: torch.Tensor


def _confidence_terms(
    drafter: DSparkDrafter,
    hidden_BQH: torch.Tensor,
    *,
    blocks: DraftBlocks,
    acc: torch.Tensor,
    valid: torch.Tensor,
) -> _ConfidenceTerms:
    """sum_k w_k BCE_k of the head's logits against the soft acceptance `acc`, and how far its
    predictions fall from it (dspark_loss's DSparkLossStats fields)."""
    w = blocks.weights
    zero = w.new_zeros(())
    confidence = drafter.confidence_logits(hidden_BQH, blocks.prev_ids)
    if confidence is None:
        return _ConfidenceTerms(None, zero, zero, zero, zero, valid.new_zeros(valid.shape))
    # The target is the soft acceptance, detached: the BCE trains the head (and, through its
    # input, the backbone) to predict it, never the draft to move it.
    bce = F.binary_cross_entropy_with_logits(confidence, acc.detach(), reduction="none")
    loss = (bce * w).sum()
    with torch.no_grad():
        prob = torch.sigmoid(confidence)
        per_block = (-1, drafter.block_size)
        cum_prob = (prob * valid).view(per_block).cumprod(-1).view_as(w)
        cum_acc = (acc * valid).view(per_block).cumprod(-1).view_as(w)
        return _ConfidenceTerms(
            logits=confidence,
            loss=loss,
            abs_error=((prob - acc).abs() * w).sum(),
            bias=((prob - acc) * w).sum(),
            cumprod_bias=((cum_prob - cum_acc) * w).sum(),
            predicted=prob * valid,
        )


def dspark_loss(
    hidden_BQH: torch.Tensor,
    *,
    lm_head: nn.Module,
    drafter: DSparkDrafter,
    blocks: DraftBlocks,
    final_BSH: torch.Tensor,
    weights: DSparkWeights,
    logits_chunk: int = 0,
    compiled: bool = False,
    fused_terms: FusedTerms = FusedTerms.inductor,
) -> DSparkLossStats:
    """The DSpark loss statistics of one batch of blocks. `final_BSH`: the target's final hidden
    states (after its final norm) [B, S, H] on the drafter's device; `blocks` built with
    label_offset=1 (they carry `prev_ids` and `final_positions`)."""
    if blocks.prev_ids is None or blocks.final_positions is None:
        raise ValueError("DSpark blocks need prev_ids and final_positions (build_blocks with label_offset=1)")
    latent_BQR = drafter.block_latents(blocks.prev_ids, hidden_BQH)
    objective, ce_sum, l1_sum, acc, hit = _weighted_terms(
        _Batch(hidden_BQH, lm_head, drafter, blocks, final_BSH, latent_BQR),
        weights=weights,
        logits_chunk=logits_chunk,
        per_chunk=chunk_terms_function(fused_terms, compiled) if logits_chunk > 0 else None,
    )
    w = blocks.weights
    valid = blocks.valid.float()
    confidence = _confidence_terms(drafter, hidden_BQH, blocks=blocks, acc=acc, valid=valid)
    if confidence.logits is not None:
        objective = objective + weights.confidence * confidence.loss
    with torch.no_grad():
        per_position = (blocks.labels.shape[0], -1, blocks.block_size)
        accepted, counted_blocks, rounds = block_acceptance(
            hit.view(per_position), blocks.valid.view(per_position), first=0
        )
        soft = (acc.detach() * valid).view(per_position)
        prob_accepted = (soft.cumprod(dim=-1).sum(dim=-1) * valid.view(per_position)[:, :, 0]).sum()
        stats = DSparkLossStats(
            weighted_ce=objective,
            weight=w.sum(),
            correct=hit.view(per_position).sum(dim=(0, 1)).float(),
            counted=valid.view(per_position).sum(dim=(0, 1)),
            accepted=accepted,
            blocks=counted_blocks,
            rounds=rounds,
            ce=ce_sum.detach(),
            l1=l1_sum.detach(),
            confidence_loss=confidence.loss.detach(),
            soft_accepted=soft.sum(dim=(0, 1)),
            prob_accepted=prob_accepted,
            confidence_abs_error=confidence.abs_error,
            confidence_bias=confidence.bias,
            confidence_cumprod_bias=confidence.cumprod_bias,
            confidence_predicted=confidence.predicted.view(per_position).sum(dim=(0, 1)),
        )
    return stats
