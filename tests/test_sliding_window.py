"""Sliding-window draft layers: the training mask is the window the serving engines apply, the
block-sparse tables describe it exactly, and a sliding drafter trains, decodes and exports as one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from dflash.config.schema import DrafterConfig
from dflash.drafters.backbone import DFlashDrafter, drafter_config
from dflash.export.contract import check_export
from dflash.export.zlab import export_drafter, load_drafter
from dflash.step.block_mask import flex_block_mask, kv_tiles
from dflash.step.blocks import block_attention_mask, layer_masks
from tests.test_block_mask import SHAPES, assert_flex_equals_sdpa, assert_tiles_cover, random_anchors
from tests.test_dflash_rules import MASK_ID, blocks_for, tiny_drafter, tiny_target

SLIDING = ["sliding_attention", "full_attention"]


def visible_by_definition(anchor: int, valid: bool, offset: int, key: int, ctx_len: int, block: int, window):
    """One (query, key) pair under the readers' rule, written out: the query at position
    anchor + offset of block `block`; `key` indexes [context 0..S-1, block keys]."""
    if key >= ctx_len:
        return (key - ctx_len) // BLOCK_SIZE == block
    inside = window is None or (anchor + offset) - key < window
    return valid and key < anchor and inside


BLOCK_SIZE = 4


@pytest.mark.parametrize("window", [4, 7, 20, None])
def test_window_mask_is_the_rule_written_out(window):
    anchors = torch.tensor([[3, 11, 25, 0]])
    valid = torch.tensor([[True, True, True, False]])
    ctx_len = 30
    mask = block_attention_mask(anchors, valid, ctx_len, BLOCK_SIZE, window)[0]
    for query in range(mask.shape[0]):
        block, offset = divmod(query, BLOCK_SIZE)
        for key in range(mask.shape[1]):
            expected = visible_by_definition(
                int(anchors[0, block]), bool(valid[0, block]), offset, key, ctx_len, block, window
            )
            assert bool(mask[query, key]) == expected, (query, key)


def test_a_window_wider_than_the_context_is_full_attention():
    anchors, valid = (torch.from_numpy(a) for a in random_anchors(2, 300, 40, seed=3))
    full = block_attention_mask(anchors, valid, 300, 4)
    assert torch.equal(block_attention_mask(anchors, valid, 300, 4, window=300 + 4), full)
    assert not torch.equal(block_attention_mask(anchors, valid, 300, 4, window=64), full)


@pytest.mark.parametrize("window", [16, 200])
@pytest.mark.parametrize("shape", SHAPES)
def test_window_tile_tables_cover_the_dense_mask_exactly(shape, window):
    batch, ctx_len, num_anchors, block_size = shape
    window = max(window, block_size)
    anchors, valid = random_anchors(batch, ctx_len, num_anchors, seed=sum(shape) + window)
    tiles = kv_tiles(anchors, valid, ctx_len, block_size, window)
    dense = block_attention_mask(
        torch.from_numpy(anchors), torch.from_numpy(valid), ctx_len, block_size, window
    )
    skipped, _ = assert_tiles_cover(tiles, dense)
    if ctx_len >= 700:  # a window over a long context leaves most key tiles out
        assert skipped > tiles.partial_count.numel()


@pytest.mark.parametrize("shape", SHAPES[:4])
def test_flex_attention_in_a_window_equals_sdpa_with_the_dense_mask(shape):
    assert_flex_equals_sdpa(shape, window=3 * shape[3] + 5, seed=2)


def _drafter_inputs(target, ctx_len=40):
    torch.manual_seed(7)
    ids = torch.randint(0, 500, (2, ctx_len))
    blocks = blocks_for(ids, torch.ones(2, ctx_len), num_anchors=8)
    features = target.features(ids).double().requires_grad_(True)
    return blocks, features, target.embed_tokens(blocks.block_ids).double()


def test_sliding_layers_see_and_train_on_the_window_only():
    """A sliding drafter's loss reaches exactly the context features some query's window holds:
    the gradient of every other position is exactly zero (nothing leaks past the window)."""
    target = tiny_target()
    window = 6
    drafter = tiny_drafter(target, layer_types=["sliding_attention"] * 2, sliding_window=window).double()
    blocks, features, emb = _drafter_inputs(target)
    masks = layer_masks(blocks.anchors, blocks.anchor_valid, 40, 4, drafter.windows)
    drafter(features, emb, blocks.positions, masks).square().sum().backward()
    seen = block_attention_mask(blocks.anchors, blocks.anchor_valid, 40, 4, window)[:, :, :40].any(dim=1)
    reached = features.grad.abs().sum(-1) > 0
    assert torch.equal(reached, seen)
    assert (~seen).sum() > 20  # the window keeps a good part of the context out here


@torch.no_grad()
def test_a_sliding_drafter_whose_window_holds_everything_is_the_full_drafter():
    target = tiny_target()
    full = tiny_drafter(target).double()
    wide = tiny_drafter(target, layer_types=SLIDING, sliding_window=48).double()
    narrow = tiny_drafter(target, layer_types=SLIDING, sliding_window=5).double()
    for drafter in (wide, narrow):
        drafter.load_state_dict(full.state_dict())
    blocks, features, emb = _drafter_inputs(target)
    out = {
        name: model(
            features,
            emb,
            blocks.positions,
            layer_masks(blocks.anchors, blocks.anchor_valid, 40, 4, model.windows),
        )
        for name, model in (("full", full), ("wide", wide), ("narrow", narrow))
    }
    torch.testing.assert_close(out["wide"], out["full"], rtol=0, atol=1e-12)
    assert not torch.allclose(out["narrow"], out["full"])


def test_a_sliding_drafter_refuses_one_mask_for_all_layers():
    target = tiny_target()
    drafter = tiny_drafter(target, layer_types=SLIDING, sliding_window=8)
    assert drafter.windows == (8, None)
    blocks, features, emb = _drafter_inputs(target)
    mask = block_attention_mask(blocks.anchors, blocks.anchor_valid, 40, 4)
    with pytest.raises(ValueError, match="pass one attention mask per window"):
        drafter(features.float(), emb.float(), blocks.positions, mask)


def test_sliding_export_has_the_fields_every_reader_needs(tmp_path):
    """The fields transformers and the engines read for a sliding layer: use_sliding_window true
    (transformers drops sliding_window otherwise), is_causal false (SGLang and vLLM run sliding
    layers causally unless told); it loads back as the same drafter and passes the export check."""
    target = tiny_target()
    drafter = tiny_drafter(target, layer_types=SLIDING, sliding_window=8)
    export_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["layer_types"] == SLIDING and config["sliding_window"] == 8
    assert config["use_sliding_window"] is True and config["is_causal"] is False
    assert check_export(tmp_path) == []
    loaded = load_drafter(tmp_path)
    assert loaded.windows == (8, None) and loaded.layer_windows == [8, None]

    for key, value, expected in (
        ("use_sliding_window", False, "use_sliding_window"),
        ("is_causal", None, "is_causal"),
        ("sliding_window", 2, "shorter than block_size"),
    ):
        broken = dict(config)
        if value is None:
            broken.pop(key)
        else:
            broken[key] = value
        (tmp_path / "config.json").write_text(json.dumps(broken))
        problems = check_export(tmp_path)
        assert any(expected in problem for problem in problems), (key, problems)


def test_a_causal_drafter_config_is_refused():
    target = tiny_target()
    cfg = DrafterConfig(name="t", num_layers=2, block_size=4, mask_token_id=MASK_ID)
    config = drafter_config(cfg, target.config, target.layer_ids)
    config.is_causal = True
    with pytest.raises(ValueError, match="is_causal: true"):
        DFlashDrafter(config)


@pytest.mark.gpu
def test_flex_window_gradients_equal_the_dense_reference_on_cuda():
    """CPU flex_attention has no backward: the sparse kernel's gradients are checked on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    batch, ctx_len, num_anchors, block_size, window = 2, 3000, 96, 16, 512
    anchors, valid = random_anchors(batch, ctx_len, num_anchors, seed=9)
    anchors_t, valid_t = torch.from_numpy(anchors).cuda(), torch.from_numpy(valid).cuda()
    tiles = kv_tiles(anchors, valid, ctx_len, block_size, window).to("cuda")
    block_mask = flex_block_mask(tiles, anchors_t, valid_t, ctx_len, block_size, window)
    dense = block_attention_mask(anchors_t, valid_t, ctx_len, block_size, window)[:, None]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_len = num_anchors * block_size
    shapes = ((batch, 8, q_len, 64), (batch, 4, ctx_len + q_len, 64), (batch, 4, ctx_len + q_len, 64))
    inputs = [torch.randn(s, generator=gen, device="cuda", requires_grad=True) for s in shapes]
    grads = {}
    for name in ("sparse", "dense"):
        if name == "sparse":
            out = torch.compile(flex_attention)(*inputs, block_mask=block_mask, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(*inputs, attn_mask=dense, enable_gqa=True)
        grads[name] = (out, *torch.autograd.grad(out.square().sum(), inputs))
    for sparse, reference in zip(grads["sparse"], grads["dense"]):
        torch.testing.assert_close(sparse, reference, rtol=2e-3, atol=2e-3)
    assert np.isfinite(grads["sparse"][1].sum().item())


def test_a_sliding_layer_whose_window_transformers_drops_is_refused_on_load(tmp_path):
    """use_sliding_window false: transformers reads sliding_window as null, so which attention
    the drafter trained with cannot be told; it is refused, not run as full attention."""
    drafter = tiny_drafter(tiny_target(), layer_types=SLIDING, sliding_window=8)
    export_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_sliding_window": False}))
    with pytest.raises(ValueError, match="sliding_window is null"):
        load_drafter(tmp_path)
