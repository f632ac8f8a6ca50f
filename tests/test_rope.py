"""dflash.drafters.rope.rotate, the rotary embedding the drafter and the static-cache decoder
apply, against each target family's own `apply_rotary_pos_emb` in transformers: bit for bit,
partial rotary (Qwen3-Next, Qwen3.5) and Qwen3.5's multimodal positions included. A drafter
graph calling transformers' function would guard on the `kernels` hub's process-wide record
(tests/test_compile_threads.py)."""

from __future__ import annotations

import sys

import pytest
import torch

from dflash.drafters.rope import rotate
from dflash.target.families import is_deltanet_layer
from tests.test_static_decoding import SAVED, TARGETS, family_target


@pytest.mark.parametrize("arch", sorted(TARGETS) + SAVED)
def test_rotate_is_each_familys_own_rotary_embedding(arch, request):
    model = family_target(arch, request).model
    attention = next(layer.self_attn for layer in model.base_model.layers if not is_deltanet_layer(layer))
    rotary = model.base_model.rotary_emb
    families_own = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads = model.config.get_text_config().num_attention_heads, attention.config.num_key_value_heads
    q = torch.randn(2, heads, 6, attention.head_dim, generator=generator)
    k = torch.randn(2, kv_heads, 6, attention.head_dim, generator=generator)
    positions = torch.tensor([[0, 1, 2, 3, 40, 41], [5, 6, 7, 8, 9, 900]])
    if hasattr(rotary, "mrope_section"):  # Qwen3.5: (temporal, height, width), all the text position
        positions = positions.expand(3, *positions.shape)
    cos, sin = rotary(q, positions)
    want_q, want_k = families_own(q, k, cos, sin)
    assert torch.equal(rotate(q, cos, sin), want_q) and torch.equal(rotate(k, cos, sin), want_k)
    assert not torch.equal(want_q, q)  # positions past 0 really turn
    if cos.shape[-1] < attention.head_dim:  # partial rotary: the channels past it pass unchanged
        assert torch.equal(rotate(q, cos, sin)[..., cos.shape[-1] :], q[..., cos.shape[-1] :])
