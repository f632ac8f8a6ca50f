"""The training attention mask in block-sparse form, for flex_attention.

`blocks.block_attention_mask` is the reference: a dense [B, Q, S + Q] bool mask. At the paper's
shape (3072 context tokens, 512 anchors x 16) about 84% of it is empty, yet SDPA computes every
(query, key) score. Here the same mask is described per 128 x 128 tile, so the kernel skips the
tiles no query may see and evaluates the element-wise rule only on tiles that are partly visible.

The tile tables are computed on the host from the host-side anchors (numpy, before the batch is
sent to the device), so building the mask never reads a device value back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from dflash.step.blocks import DraftBlocks, host_to_device

TILE = 128  # flex_attention's sparse block size (queries and keys)


@dataclass
class KvTiles:
    """flex_attention's key-tile tables, [B, 1, q_tiles] counts and [B, 1, q_tiles, kv_tiles]
    indices: `partial` tiles need the element-wise rule, `full` tiles are entirely visible."""

    partial_count: torch.Tensor
    partial_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor
    q_len: int
    kv_len: int

    def to(self, device: torch.device, non_blocking: bool = False) -> KvTiles:
        moved = {
            name: host_to_device(getattr(self, name), device, non_blocking)
            for name in ("partial_count", "partial_index", "full_count", "full_index")
        }
        return KvTiles(**moved, q_len=self.q_len, kv_len=self.kv_len)


def _tile_reduce(per_query: np.ndarray, num_tiles: int, pad: int, reduce) -> np.ndarray:
    """[B, Q] -> [B, num_tiles] reduced over each tile's queries (missing queries = pad)."""
    batch, q_len = per_query.shape
    padded = np.full((batch, num_tiles * TILE), pad, dtype=per_query.dtype)
    padded[:, :q_len] = per_query
    return reduce(padded.reshape(batch, num_tiles, TILE), axis=2)


def _with_head_dim(table: np.ndarray) -> torch.Tensor:
    """[B, ...] -> [B, 1, ...] with the strides of a freshly allocated tensor.

    The CUDA kernel finds sample b's row at (b * H + h) * stride(1): it assumes stride(0) ==
    H * stride(1). numpy's `table[:, None]` gives the head axis stride 0, which is still
    "contiguous" to numpy and torch (a size-1 axis), so every sample silently read sample 0's
    tables and attended to the wrong tiles (CPU kernels index each axis and were right).
    torch's unsqueeze gives the new axis the stride of the axis it sits before."""
    return torch.from_numpy(np.ascontiguousarray(table)).unsqueeze(1)


def _as_tables(visible: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, q_tiles, kv_tiles] bool -> (count [B, 1, q], indices [B, 1, q, kv]) with the visible
    tiles first, in increasing key order (the order the kernel walks them)."""
    count = visible.sum(axis=2).astype(np.int32)
    order = np.argsort(~visible, axis=2, kind="stable").astype(np.int32)
    return _with_head_dim(count), _with_head_dim(order)


def _context_tiles(
    anchors_BA: np.ndarray,
    anchor_valid_BA: np.ndarray,
    block_size: int,
    window: int | None,
    q_tiles: int,
    k_tiles: int,
) -> tuple[np.ndarray, np.ndarray]:
    """[B, q_tiles, k_tiles] (any, full): the context keys of a key tile some / every query of
    the query tile may see. A query sees the keys [lo, hi): hi = its anchor (0 for a padding
    block), lo = 0, or with a window its position - window + 1."""
    sees_until = np.where(anchor_valid_BA, anchors_BA, 0).repeat(block_size, axis=1)  # [B, Q]
    tile_start = np.arange(k_tiles) * TILE
    tile_max = _tile_reduce(sees_until, q_tiles, pad=0, reduce=np.max)
    tile_min = _tile_reduce(sees_until, q_tiles, pad=0, reduce=np.min)
    # Entirely visible: every query of the tile sees the whole key tile. A tile of missing
    # queries (pad 0) is never full.
    full = (tile_start + TILE)[None, None, :] <= tile_min[:, :, None]
    if window is None:
        # Every interval starts at 0: a key tile is seen iff it starts before the largest anchor.
        return tile_start[None, None, :] < tile_max[:, :, None], full
    offsets = np.arange(sees_until.shape[1]) % block_size
    sees_from = np.maximum(anchors_BA.repeat(block_size, axis=1) + offsets - window + 1, 0)  # [B, Q]
    full &= tile_start[None, None, :] >= _tile_reduce(sees_from, q_tiles, pad=0, reduce=np.max)[:, :, None]
    # Windows of blocks far apart need not overlap: test each query's own interval.
    batch = sees_until.shape[0]
    hi = np.zeros((batch, q_tiles * TILE), dtype=np.int64)
    lo = np.zeros((batch, q_tiles * TILE), dtype=np.int64)
    hi[:, : sees_until.shape[1]], lo[:, : sees_from.shape[1]] = sees_until, sees_from
    hi, lo = hi.reshape(batch, q_tiles, TILE, 1), lo.reshape(batch, q_tiles, TILE, 1)
    starts = tile_start[None, None, None, :]
    seen = (lo < starts + TILE) & (starts < hi) & (lo < hi)
    return seen.any(axis=2), full


def kv_tiles(
    anchors_BA: np.ndarray,
    anchor_valid_BA: np.ndarray,
    ctx_len: int,
    block_size: int,
    window: int | None = None,
) -> KvTiles:
    """Which key tiles each query tile may see, under the rule of `block_attention_mask`:
    context key i < anchor (valid blocks only; with a window, also inside it), plus the keys of
    the query's own block."""
    batch, num_blocks = anchors_BA.shape
    q_len = num_blocks * block_size
    kv_len = ctx_len + q_len
    q_tiles, k_tiles = -(-q_len // TILE), -(-kv_len // TILE)
    ctx_any, ctx_full = _context_tiles(anchors_BA, anchor_valid_BA, block_size, window, q_tiles, k_tiles)

    # Own block: query tile t holds blocks first..last, whose keys sit at ctx_len + j * block_size.
    q_start = np.arange(q_tiles) * TILE
    first_block = q_start // block_size
    last_block = (np.minimum(q_start + TILE, q_len) - 1) // block_size
    lo = (ctx_len + first_block * block_size) // TILE
    hi = (ctx_len + (last_block + 1) * block_size - 1) // TILE
    own = (np.arange(k_tiles)[None, :] >= lo[:, None]) & (np.arange(k_tiles)[None, :] <= hi[:, None])

    full = ctx_full & ~own[None]
    partial = (ctx_any | own[None]) & ~full
    partial_count, partial_index = _as_tables(partial)
    full_count, full_index = _as_tables(full)
    return KvTiles(partial_count, partial_index, full_count, full_index, q_len=q_len, kv_len=kv_len)


def tiles_for(blocks: DraftBlocks, ctx_len: int, window: int | None = None) -> KvTiles:
    """The tile tables of a batch of blocks still on the host (before `blocks.to(device)`)."""
    return kv_tiles(blocks.anchors.numpy(), blocks.anchor_valid.numpy(), ctx_len, blocks.block_size, window)


def tiles_by_window(
    blocks: DraftBlocks, ctx_len: int, windows: tuple[int | None, ...]
) -> dict[int | None, KvTiles]:
    """`tiles_for` each distinct window of a drafter's layers (None: full attention)."""
    return {window: tiles_for(blocks, ctx_len, window) for window in windows}


def flex_block_mask(
    tiles: KvTiles,
    anchors_BA: torch.Tensor,
    anchor_valid_BA: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: int | None = None,
) -> BlockMask:
    """The BlockMask of `tiles` (on the anchors' device) with the element-wise rule for the
    partial tiles. Built from the tables alone: no device value is read on the host."""
    last_block = anchors_BA.shape[1] - 1

    def visible(b, h, q_idx, kv_idx):
        # The kernel may evaluate queries past the end of a partial last tile: clamp the index.
        block = torch.clamp(q_idx // block_size, max=last_block)
        anchor = anchors_BA[b, block]
        sees_context = (kv_idx < anchor) & anchor_valid_BA[b, block]
        if window is not None:
            sees_context = sees_context & (kv_idx > anchor + q_idx % block_size - window)
        own_block = (kv_idx >= ctx_len) & ((kv_idx - ctx_len) // block_size == block)
        return sees_context | own_block

    return BlockMask.from_kv_blocks(
        tiles.partial_count,
        tiles.partial_index,
        tiles.full_count,
        tiles.full_index,
        BLOCK_SIZE=TILE,
        mask_mod=visible,
        seq_lengths=(tiles.q_len, tiles.kv_len),
    )
