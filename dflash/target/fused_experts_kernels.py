"""The Triton kernels of dflash/target/fused_experts.py (imported there on first use: triton is
the `gpu` extra, and a CPU run never imports this module). Each program computes one (row tile,
column tile) of one expert's run of rows; see that module for the layout."""

import triton
import triton.language as tl


@triton.jit
def tile_of_program(
    tile_expert_ptr, row_pair_ptr, pairs, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """This program's tiles: its row tile's expert, rows, (token, slot) pairs and which rows
    hold one, and its column tile's columns. Column tiles of one row tile run side by side
    (they share its gathered rows in L2), and a run's row tiles follow one another (they
    share the expert's weights)."""
    n_tiles = tl.cdiv(n_cols, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    expert = tl.load(tile_expert_ptr + pid_m)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair_ptr + rows)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, pair, pair < pairs, pid_n, cols


@triton.jit
def gate_up_swiglu(
    x_ptr, xs_ptr, w_ptr, s_ptr, row_pair_ptr, tile_expert_ptr, out_ptr,
    pairs, num_experts, hidden, inter, top_k,
    stride_xt, stride_xst, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    FP8: tl.constexpr, A8: tl.constexpr, SCALE_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A8: `x` holds e4m3 activations with one scale per (token, SCALE_BLOCK columns) at
    `xs_ptr` (BLOCK_K divides SCALE_BLOCK): FP8 x FP8 products, scaled by both blocks' scales."""
    expert, rows, pair, valid, pid_n, cols = tile_of_program(
        tile_expert_ptr, row_pair_ptr, pairs, inter, BLOCK_M, BLOCK_N
    )
    if expert >= num_experts:  # a spare tile of the bound
        return
    token = tl.where(valid, pair // top_k, 0).to(tl.int64)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    gate_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        a = tl.load(
            x_ptr + token[:, None] * stride_xt + k[None, :],
            mask=valid[:, None] & (k[None, :] < hidden),
            other=0.0,
        )
        w_mask = (k[:, None] < hidden) & col_ok[None, :]
        gate_w = tl.load(w_expert + cols[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        up_w = tl.load(w_expert + (cols[None, :] + inter) * stride_wn + k[:, None], mask=w_mask, other=0.0)
        if FP8:
            s_expert = s_ptr + expert.to(tl.int64) * stride_se + (k0 // SCALE_BLOCK) * stride_sk
            gate_s = tl.load(s_expert + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_sn)
            up_s = tl.load(s_expert + ((pid_n * BLOCK_N + inter) // SCALE_BLOCK) * stride_sn)
            if A8:
                a_s = tl.load(xs_ptr + token * stride_xst + k0 // SCALE_BLOCK, mask=valid, other=0.0)
                gate_acc += tl.dot(a, gate_w) * (a_s[:, None] * gate_s)
                up_acc += tl.dot(a, up_w) * (a_s[:, None] * up_s)
            else:
                gate_acc += tl.dot(a, gate_w.to(a.dtype), input_precision=PRECISION) * gate_s
                up_acc += tl.dot(a, up_w.to(a.dtype), input_precision=PRECISION) * up_s
        else:
            gate_acc = tl.dot(a, gate_w, gate_acc, input_precision=PRECISION)
            up_acc = tl.dot(a, up_w, up_acc, input_precision=PRECISION)
    act = gate_acc / (1.0 + tl.exp(-gate_acc)) * up_acc
    out = out_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :]
    tl.store(out, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def down_weighted(
    h_ptr, hs_ptr, w_ptr, s_ptr, row_pair_ptr, tile_expert_ptr, weights_ptr, out_ptr,
    pairs, num_experts, hidden, inter,
    stride_hst, stride_we, stride_wn, stride_se, stride_sn, stride_sk,
    FP8: tl.constexpr, A8: tl.constexpr, SCALE_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A8: `h` holds e4m3 rows with one scale per (row, SCALE_BLOCK columns) at `hs_ptr`."""
    expert, rows, pair, valid, pid_n, cols = tile_of_program(
        tile_expert_ptr, row_pair_ptr, pairs, hidden, BLOCK_M, BLOCK_N
    )
    if expert >= num_experts:  # a spare tile of the bound
        return
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        a = tl.load(
            h_ptr + rows.to(tl.int64)[:, None] * inter + k[None, :],
            mask=valid[:, None] & (k[None, :] < inter),
            other=0.0,
        )
        w = tl.load(
            w_expert + cols[None, :] * stride_wn + k[:, None],
            mask=(k[:, None] < inter) & col_ok[None, :],
            other=0.0,
        )
        if FP8:
            s = tl.load(
                s_ptr
                + expert.to(tl.int64) * stride_se
                + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_sn
                + (k0 // SCALE_BLOCK) * stride_sk
            )
            if A8:
                a_s = tl.load(
                    hs_ptr + rows.to(tl.int64) * stride_hst + k0 // SCALE_BLOCK, mask=valid, other=0.0
                )
                acc += tl.dot(a, w) * (a_s[:, None] * s)
            else:
                acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION) * s
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out = out_ptr + pair.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])
