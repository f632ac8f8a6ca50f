"""The Triton kernel of dflash/target/router.py (imported there on first use: triton is the `gpu`
extra, and a CPU run never imports this module)."""

import triton
import triton.language as tl


@triton.jit
def rows_top_k(
    x_ptr, values_ptr, indices_ptr, rows, cols,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Each program: BLOCK_M rows of x [rows, cols] (fp32, contiguous) held whole in registers; K
    times the row's largest value (the lowest column among equals) is written out, then masked."""
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.arange(0, BLOCK_E)
    inside = (row[:, None] < rows) & (col[None, :] < cols)
    x = tl.load(x_ptr + row[:, None] * cols + col[None, :], mask=inside, other=float("-inf"))
    for k in tl.static_range(K):
        best = tl.max(x, axis=1)
        at = tl.min(tl.where(x == best[:, None], col[None, :], BLOCK_E), axis=1)
        tl.store(values_ptr + row * K + k, best, mask=row < rows)
        tl.store(indices_ptr + row * K + k, at.to(tl.int64), mask=row < rows)
        x = tl.where(col[None, :] == at[:, None], float("-inf"), x)
