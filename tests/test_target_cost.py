"""Useful FLOPs of a target's feature forward, part by part (scripts/bench_target.py, bench_step):
only the experts a token is routed to, causal attention in full-attention layers only, the
DeltaNet recurrence in linear-attention layers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.target.model import FrozenTarget
from dflash.tools.target_cost import layer_parts, part_flops


def test_moe_hybrid_flops_count_the_routed_experts_and_each_layer_kind_once(tiny_qwen3_next_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_next_dir)
    target = FrozenTarget(model, [3])  # layers 0..3: linear, full, linear, full (interval 2)
    c = model.config
    batch, seq = 2, 10
    tokens, pairs = batch * seq, batch * seq * (seq + 1) / 2
    flops = part_flops(target, batch=batch, seq_len=seq)
    h, moe = c.hidden_size, c.moe_intermediate_size
    # Per token, each of its top-2 of 4 experts: gate, up and down projections.
    assert flops["experts"] == pytest.approx(4 * 2 * tokens * c.num_experts_per_tok * 3 * h * moe)
    assert flops["router"] == pytest.approx(4 * 2 * tokens * h * c.num_experts)
    shared = 3 * h * c.shared_expert_intermediate_size + h  # its MLP and its one-output gate
    assert flops["shared expert"] == pytest.approx(4 * 2 * tokens * shared)
    attention_linear = sum(
        m.weight.numel() for m in model.model.layers[1].self_attn.modules() if isinstance(m, torch.nn.Linear)
    )
    causal = 4 * c.num_attention_heads * c.head_dim * pairs
    assert flops["full attention"] == pytest.approx(2 * (2 * attention_linear * tokens + causal))
    recurrence = 4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * tokens
    deltanet_linear = sum(
        m.weight.numel()
        for m in model.model.layers[0].linear_attn.modules()
        if isinstance(m, torch.nn.Linear)
    )
    assert flops["linear attention"] == pytest.approx(2 * (2 * deltanet_linear * tokens + recurrence))


def test_a_dense_target_has_attention_and_dense_mlp_parts_only(tiny_qwen3_dir):
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir), [1, 3])
    assert [part for part, _ in layer_parts(target.model.model.layers[0])] == ["full attention", "dense MLP"]
    assert set(part_flops(target, batch=1, seq_len=8)) == {"full attention", "dense MLP"}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_a_token_step_reads_every_weight_but_the_unrouted_experts(family, request):
    """bench_decode's weights floor: a dense target's step reads all its weights; a MoE target's
    reads the experts a token is routed to (top-2 of 4 here: half the routed experts' bytes)."""
    from dflash.tools.target_cost import token_weight_bytes

    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(f"tiny_{family}_dir"))
    target = FrozenTarget(model, [3])
    every = sum(p.numel() * p.element_size() for p in model.parameters())
    routed = sum(
        p.numel() * p.element_size()
        for layer in model.model.layers
        if hasattr(getattr(layer, "mlp", None), "experts")
        for p in layer.mlp.experts.parameters()
    )
    share = model.config.num_experts_per_tok / model.config.num_experts if routed else 0.0
    assert (routed > 0) == (family == "qwen3_next")
    assert token_weight_bytes(target) == pytest.approx(every - routed + share * routed)
