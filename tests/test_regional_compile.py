"""target.compile_scope=layers: each decoder layer compiled apart, one graph per layer kind
whatever the depth, the same features as the eager stack, decoding left eager."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.models.compile import CompileCounter
from dflash.models.target import FrozenTarget


def graphs_compiled(directory, layer_ids: list[int]) -> tuple[int, FrozenTarget, torch.Tensor]:
    torch._dynamo.reset()
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(directory), layer_ids)
    counter = CompileCounter("target", backend=lambda graph, inputs: graph.forward)
    target.compile_features(counter, scope="layers")
    ids = torch.randint(1, 500, (2, 17))
    torch.testing.assert_close(target.features(ids), target.reference_features(ids), rtol=0, atol=0)
    return counter.graphs, target, ids


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next", "qwen3_5_moe"])
def test_layer_graphs_do_not_grow_with_depth_and_match_the_eager_stack(family, request):
    directory = request.getfixturevalue(f"tiny_{family}_dir")
    shallow, _, _ = graphs_compiled(directory, [1, 3])  # 4 layers run
    deep, target, ids = graphs_compiled(directory, [5])  # all 6
    assert 0 < deep == shallow
    # The model's own layers (what decoding runs) were not compiled.
    assert all(layer._compiled_call_impl is None for layer in target.model.base_model.layers)
    with torch.no_grad():
        full = target.model(ids, output_hidden_states=True)
    torch.testing.assert_close(target.features(ids), full.hidden_states[6], rtol=0, atol=0)


def test_an_unknown_scope_is_refused_naming_the_key(tiny_qwen3_dir):
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir), [1, 3])
    with pytest.raises(ValueError, match="target.compile_scope='model'"):
        target.compile_features(CompileCounter("t"), scope="model")
