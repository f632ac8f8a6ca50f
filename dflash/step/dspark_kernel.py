"""DSpark's vocabulary-wide terms of one chunk of rows in one Triton kernel (`variant.fused_terms=triton`).

The fused head (dflash/step/dspark_loss.py) needs, per labelled row with draft logits z and the
target's logits t over the vocabulary, p = softmax(z), q = softmax(t):
    CE = lse(z) - z[label],  L1 = sum_v |p_v - q_v|,  acc = clamp(1 - L1 / 2, 0, 1),
    hit = argmax(z) == label (the first maximum, as torch.argmax),
    dz = w (ce_weight (p - onehot(label)) + tv_weight p (s - sum_v s_v p_v)),  s = sign(p - q).
One program per row walks the vocabulary three times in tiles: (1) the running maximum and sum
of exponentials of z and of t (online softmax) and z's argmax; (2) L1 and sum_v s_v p_v; (3) dz,
written in the logits' dtype. Everything in fp32. Reads z and t three times and writes dz once:
14 bytes per logit in bf16, where the compiled PyTorch formula splits the vocabulary reduction
over several kernels and intermediate buffers. The target's rows are read through an index
(overlapping blocks share positions, whose logits are computed once). `chunk_terms_and_grads` here returns what
`_chunk_terms_and_grads` there returns; tests hold the two together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _logits_tile(z_row, t_row, cols, vocab):
    """Draft and target logits of `cols` in fp32 (-inf past the vocabulary: no mass, no max)."""
    inside = cols < vocab
    z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
    t = tl.load(t_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
    return z, t, inside


@triton.jit
def _p_diff_sign(z, t, lse_z, lse_t):
    """p = softmax(z), p - q and sign(p - q), q = softmax(t), from the two log-normalisers."""
    p = tl.exp(z - lse_z)
    diff = p - tl.exp(t - lse_t)
    return p, diff, tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))


@triton.jit
def _dspark_terms_kernel(
    z_ptr,
    t_ptr,
    t_rows_ptr,
    labels_ptr,
    weights_ptr,
    grad_ptr,
    ce_ptr,
    l1_ptr,
    hit_ptr,
    vocab,
    stride_z,
    stride_t,
    stride_grad,
    ce_weight,
    tv_weight,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    t_row = t_ptr + tl.load(t_rows_ptr + row).to(tl.int64) * stride_t  # rows share positions
    offsets = tl.arange(0, BLOCK)
    label = tl.load(labels_ptr + row)
    weight = tl.load(weights_ptr + row)

    # Pass 1: online maxima and sums of exponentials; z's first maximum.
    m_z = tl.full((BLOCK,), float("-inf"), tl.float32)
    m_t = tl.full((BLOCK,), float("-inf"), tl.float32)
    s_z = tl.zeros((BLOCK,), tl.float32)
    s_t = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_at = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        z, t, inside = _logits_tile(z_row, t_row, cols, vocab)
        new_z, new_t = tl.maximum(m_z, z), tl.maximum(m_t, t)
        # A lane that has seen only -inf keeps sum 0 (exp(-inf - -inf) would be NaN).
        s_z = tl.where(new_z == float("-inf"), 0.0, s_z * tl.exp(m_z - new_z) + tl.exp(z - new_z))
        s_t = tl.where(new_t == float("-inf"), 0.0, s_t * tl.exp(m_t - new_t) + tl.exp(t - new_t))
        m_z, m_t = new_z, new_t
        better = z > best  # strictly: each lane keeps its first maximum, lanes see increasing columns
        best_at = tl.where(better, cols, best_at)
        best = tl.where(better, z, best)
    max_z, max_t = tl.max(m_z, axis=0), tl.max(m_t, axis=0)
    lse_z = max_z + tl.log(tl.sum(s_z * tl.exp(m_z - max_z), axis=0))
    lse_t = max_t + tl.log(tl.sum(s_t * tl.exp(m_t - max_t), axis=0))
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_at, vocab), axis=0)

    # Pass 2: L1 and sum_v sign(p_v - q_v) p_v.
    l1 = tl.zeros((BLOCK,), tl.float32)
    signed = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        z, t, inside = _logits_tile(z_row, t_row, cols, vocab)
        p, diff, sign = _p_diff_sign(z, t, lse_z, lse_t)
        l1 += tl.abs(diff)
        signed += sign * p
    l1_sum = tl.sum(l1, axis=0)
    signed_sum = tl.sum(signed, axis=0)

    # Pass 3: the gradient of w (ce_weight CE + tv_weight L1) with respect to z.
    for start in range(0, vocab, BLOCK):
        cols = start + offsets
        z, t, inside = _logits_tile(z_row, t_row, cols, vocab)
        p, _, sign = _p_diff_sign(z, t, lse_z, lse_t)
        onehot = tl.where(cols == label, 1.0, 0.0)
        grad = weight * (ce_weight * (p - onehot) + tv_weight * p * (sign - signed_sum))
        tl.store(grad_ptr + row * stride_grad + cols, grad.to(grad_ptr.dtype.element_ty), mask=inside)

    z_label = tl.load(z_row + label).to(tl.float32)
    tl.store(ce_ptr + row, lse_z - z_label)
    tl.store(l1_ptr + row, l1_sum)
    tl.store(hit_ptr + row, (first == label).to(tl.int8))


def chunk_terms_and_grads(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    target_rows: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    ce_weight: float,
    tv_weight: float,
) -> tuple[torch.Tensor, ...]:
    """(CE, L1, acc, hit) per row and d(sum w (ce_weight CE + tv_weight L1))/dz in the logits'
    dtype, from [n, V] draft logits and row n's target logits `target_logits[target_rows[n]]`,
    every row contiguous."""
    rows, vocab = draft_logits.shape
    if draft_logits.stride(1) != 1 or target_logits.stride(1) != 1:
        raise ValueError("the fused DSpark terms read logits rows that are contiguous")
    grad = torch.empty_like(draft_logits)
    ce, l1 = (draft_logits.new_empty(rows, dtype=torch.float32) for _ in range(2))
    hit = torch.empty(rows, dtype=torch.int8, device=draft_logits.device)
    if rows:
        _dspark_terms_kernel[(rows,)](
            draft_logits,
            target_logits,
            target_rows,
            labels,
            weights.float(),
            grad,
            ce,
            l1,
            hit,
            vocab,
            draft_logits.stride(0),
            target_logits.stride(0),
            grad.stride(0),
            float(ce_weight),
            float(tv_weight),
            BLOCK=min(2048, triton.next_power_of_2(vocab)),
            num_warps=8,
        )
    acc = (1.0 - 0.5 * l1).clamp(0.0, 1.0)
    return ce, l1, acc, hit.bool(), grad
