"""drafter.compile_scope: the drafter's training graph compiled whole (`stack`) or one layer at a
time (`layers`, one graph every layer reuses): the same hidden states and gradients as the
eager drafter, and with `layers` a graph count that does not grow with the depth."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash.config.schema import DrafterConfig
from dflash.drafters.backbone import DFlashDrafter, drafter_config
from dflash.drafters.dflash2 import DFlash2Drafter, add_dflash2_fields
from dflash.step.blocks import block_attention_mask
from tests.test_dflash_rules import MASK_ID, blocks_for, tiny_target


def drafter_of_depth(target, layers: int, variant: str) -> DFlashDrafter:
    cfg = DrafterConfig(name="t", num_layers=layers, block_size=4, mask_token_id=MASK_ID, num_anchors=8)
    config = drafter_config(cfg, target.config, target.layer_ids)
    torch.manual_seed(1)
    if variant == "dflash":
        return DFlashDrafter(config)
    config = add_dflash2_fields(
        config, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4
    )
    drafter = DFlash2Drafter(config)
    with torch.no_grad():  # convolutions away from the identity, so they count
        for name, param in drafter.named_parameters():
            if "conv" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return drafter


def forward_backward(drafter, target, ids):
    blocks = blocks_for(ids, torch.ones(1, ids.shape[1]), num_anchors=3)
    mask = block_attention_mask(blocks.anchors, blocks.anchor_valid, ids.shape[1], 4)
    hidden = drafter(target.features(ids), target.embed_tokens(blocks.block_ids), blocks.positions, mask)
    hidden.square().mean().backward()
    return hidden.detach(), {name: p.grad for name, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_layer_scope_reuses_one_graph_at_any_depth_and_equals_the_eager_drafter(variant):
    torch._dynamo.reset()
    target = tiny_target()
    ids = torch.randint(0, 500, (1, 20))
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    counts = []
    for depth in (2, 4):
        drafter = drafter_of_depth(target, depth, variant)
        eager = copy.deepcopy(drafter)
        drafter.compile_training(counting_backend, scope="layers")
        hidden, grads = forward_backward(drafter, target, ids)
        want_hidden, want_grads = forward_backward(eager, target, ids)
        torch.testing.assert_close(hidden, want_hidden)
        assert grads.keys() == want_grads.keys() and any(".1." in name for name in grads)
        for name in grads:
            torch.testing.assert_close(grads[name], want_grads[name], msg=name)
        counts.append(len(graphs))
    assert counts[0] >= 1 and counts[1] == counts[0], counts  # the 4-layer drafter reused the graph


def test_an_unknown_drafter_compile_scope_is_refused_naming_the_key():
    drafter = drafter_of_depth(tiny_target(), 2, "dflash")
    with pytest.raises(ValueError, match="drafter.compile_scope='model'"):
        drafter.compile_training(scope="model")
