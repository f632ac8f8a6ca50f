"""The block-sparse training mask (flex_attention) describes exactly the dense reference mask."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from dflash.step.block_mask import TILE, flex_block_mask, kv_tiles
from dflash.step.blocks import block_attention_mask
from tests.test_dflash_rules import blocks_for, tiny_drafter, tiny_target

# (batch, context length, anchors, block size): block sizes that divide the tile and that do not,
# contexts that end mid-tile, fewer queries than one tile, padding blocks.
SHAPES = [(2, 300, 40, 4), (3, 257, 20, 12), (1, 700, 64, 16), (2, 130, 9, 16), (2, 3000, 96, 16)]


def random_anchors(batch, ctx_len, num_anchors, seed):
    rng = np.random.default_rng(seed)
    anchors = np.sort(rng.integers(1, ctx_len - 1, size=(batch, num_anchors)), axis=1)
    valid = rng.random((batch, num_anchors)) < 0.85
    valid[:, 0] = True
    valid[-1, num_anchors // 2 :] = False  # a sample with fewer anchors than the batch's widest
    return np.where(valid, anchors, 0), valid


def tile_of(dense_BQK: torch.Tensor, b: int, q_tile: int, kv_tile: int) -> torch.Tensor:
    return dense_BQK[b, q_tile * TILE : (q_tile + 1) * TILE, kv_tile * TILE : (kv_tile + 1) * TILE]


def assert_tiles_cover(tiles, dense: torch.Tensor) -> tuple[int, int]:
    """Every skipped tile of `tiles` is invisible in `dense`, every full tile entirely visible,
    no tile both; returns the (skipped, full) tile counts."""
    q_tiles, kv_tiles_total = -(-dense.shape[1] // TILE), -(-dense.shape[2] // TILE)
    skipped = full = 0
    for b in range(dense.shape[0]):
        for t in range(q_tiles):
            partial_set = set(tiles.partial_index[b, 0, t, : tiles.partial_count[b, 0, t]].tolist())
            full_set = set(tiles.full_index[b, 0, t, : tiles.full_count[b, 0, t]].tolist())
            assert not partial_set & full_set
            for k in range(kv_tiles_total):
                block = tile_of(dense, b, t, k)
                if k in full_set:
                    assert block.all(), (b, t, k)
                    full += 1
                elif k not in partial_set:
                    assert not block.any(), (b, t, k)
                    skipped += 1
    return skipped, full


@pytest.mark.parametrize("shape", SHAPES)
def test_tile_tables_cover_the_dense_mask_exactly(shape):
    """A skipped tile must be entirely invisible, a full tile entirely visible; partial tiles get
    the element-wise rule. This is what makes the sparse kernel compute the dense result."""
    batch, ctx_len, num_anchors, block_size = shape
    anchors, valid = random_anchors(batch, ctx_len, num_anchors, seed=sum(shape))
    tiles = kv_tiles(anchors, valid, ctx_len, block_size)
    dense = block_attention_mask(torch.from_numpy(anchors), torch.from_numpy(valid), ctx_len, block_size)
    skipped, full = assert_tiles_cover(tiles, dense)
    if ctx_len >= 700:  # long contexts: most tiles are skipped or need no element-wise rule
        assert skipped > 0 and full > 0


def assert_flex_equals_sdpa(shape, window: int | None, seed: int) -> None:
    """flex_attention through the tile tables and mask rule of `shape` (with `window`: a
    sliding layer's) gives SDPA's result with the dense mask, to float64 rounding."""
    batch, ctx_len, num_anchors, block_size = shape
    anchors, valid = random_anchors(batch, ctx_len, num_anchors, seed=seed)
    anchors_t, valid_t = torch.from_numpy(anchors), torch.from_numpy(valid)
    tiles = kv_tiles(anchors, valid, ctx_len, block_size, window)
    block_mask = flex_block_mask(tiles, anchors_t, valid_t, ctx_len, block_size, window)
    dense = block_attention_mask(anchors_t, valid_t, ctx_len, block_size, window)
    q_len = num_anchors * block_size
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 4, q_len, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, 2, ctx_len + q_len, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None], enable_gqa=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        sparse = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(sparse, reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_flex_attention_with_the_block_mask_equals_sdpa_with_the_dense_mask(shape):
    assert_flex_equals_sdpa(shape, window=None, seed=1)


def canonical_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def test_tile_tables_have_the_strides_the_cuda_kernel_assumes():
    """The CUDA kernel reads sample b's tables at (b * heads + h) * stride(1), so stride(0) must
    equal heads * stride(1). A zero stride on the size-1 head axis (numpy's `[:, None]`) is
    "contiguous" to torch, passes every CPU check, and on the GPU made every sample of a batch
    attend through sample 0's tiles: training still ran, but the drafter did not learn."""
    anchors, valid = random_anchors(3, 1000, 48, seed=5)
    tiles = kv_tiles(anchors, valid, 1000, 16)
    moved = tiles.to(torch.device("cpu"))
    for name in ("partial_count", "partial_index", "full_count", "full_index"):
        for table in (getattr(tiles, name), getattr(moved, name)):
            assert table.stride() == canonical_strides(tuple(table.shape)), name
    # The samples' tables differ here, so reading sample 0's for all of them would matter.
    assert not torch.equal(tiles.partial_count[0], tiles.partial_count[1])


@torch.no_grad()
def test_drafter_forward_is_the_same_with_either_mask():
    target = tiny_target()
    drafter = tiny_drafter(target).double()
    ids = torch.randint(0, 500, (2, 40))
    mask = torch.ones(2, 40)
    mask[1, 30:] = 0  # fewer anchors in sample 1: padding blocks
    blocks = blocks_for(ids, mask, num_anchors=8)
    features = target.features(ids).double()
    emb = target.embed_tokens(blocks.block_ids).double()
    dense = block_attention_mask(blocks.anchors, blocks.anchor_valid, 40, 4)
    tiles = kv_tiles(blocks.anchors.numpy(), blocks.anchor_valid.numpy(), 40, 4)
    sparse = flex_block_mask(tiles, blocks.anchors, blocks.anchor_valid, 40, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(
            drafter(features, emb, blocks.positions, sparse),
            drafter(features, emb, blocks.positions, dense),
            rtol=0,
            atol=1e-10,
        )
