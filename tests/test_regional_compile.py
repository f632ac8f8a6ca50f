"""target.compile_scope=layers: each decoder layer compiled apart (a Gated DeltaNet layer whole,
its convolution and delta rule as custom ops), one graph per layer kind whatever the depth and no
graph break, the same features as the eager stack, decoding left eager."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.target.deltanet_mixer import FeatureMixer
from dflash.target.model import FrozenTarget
from dflash.torch_runtime.compile import CompileCounter


def compiled_target(directory, layer_ids: list[int], counter: CompileCounter) -> FrozenTarget:
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(directory), layer_ids)
    target.compile_features(counter, scope="layers")
    return target


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next", "qwen3_5_moe"])  # dense; hybrid + MoE
def test_layer_graphs_do_not_grow_with_depth_and_match_the_eager_stack(family, request):
    """One whole graph per layer kind (a full-attention layer; a Gated DeltaNet layer, its mixer
    as dflash's FeatureMixer: transformers' own forward, compiled, would unroll the chunked delta
    rule's loop) and no graph break inside one
    (transformers' output capturing hooks, on the decoder layers and on every MoE router, read a
    context variable dynamo cannot trace; a break splits each graph and multiplies the compile
    time)."""
    from torch._dynamo.utils import counters

    directory = request.getfixturevalue(f"tiny_{family}_dir")
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounter("target", backend=lambda graph, inputs: graph.forward)
    ids = torch.randint(1, 500, (2, 17))
    shallow = compiled_target(directory, [1, 3], counter)  # runs 4 layers
    # exact, but for Qwen3-Next's regrouped projection weights (another GEMM blocking)
    rounding = 1e-5 if family == "qwen3_next" else 0.0
    want = shallow.reference_features(ids)
    assert (shallow.features(ids) - want).abs().max() <= rounding * want.abs().max()
    graphs = counter.graphs
    deep = compiled_target(directory, [5], counter)  # all 6, another model: the same layer graphs serve
    features = deep.features(ids)
    layers = deep.model.base_model.layers
    kinds = len({hasattr(layer, "linear_attn") for layer in layers})
    assert kinds == (2 if family != "qwen3" else 1)
    assert graphs == counter.graphs == kinds, (graphs, counter.graphs, kinds)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # The model's own layers (what decoding runs) were not compiled, and keep their hooks.
    for layer in layers:
        assert "forward" not in vars(layer) and "forward" not in vars(layer.mlp)
        assert not isinstance(getattr(layer, "linear_attn", None), FeatureMixer)
    with torch.no_grad():
        full = deep.model(ids, output_hidden_states=True)
    assert (features - full.hidden_states[6]).abs().max() <= rounding * full.hidden_states[6].abs().max()


def test_an_unknown_scope_is_refused_naming_the_key(tiny_qwen3_dir):
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir), [1, 3])
    with pytest.raises(ValueError, match="target.compile_scope='model'"):
        target.compile_features(CompileCounter("t"), scope="model")


def test_a_hybrid_stack_compiled_whole_gives_the_eager_stacks_features(tiny_qwen3_next_dir):
    """scope=stack on a hybrid target: its DeltaNet layers through FeatureMixer too (compiled as
    transformers' forward, the chunked rule's loop would be unrolled), the features the eager
    stack's within fp32 rounding, the model's own mixers left to decoding."""
    from torch._dynamo.utils import counters

    from dflash.target.deltanet_mixer import FeatureMixer

    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def capture(graph, inputs):
        graphs.append(graph)
        return graph.forward

    counter = CompileCounter("target", backend=capture)
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(tiny_qwen3_next_dir), [3])
    target.compile_features(counter, scope="stack")
    ids = torch.randint(1, 500, (2, 70))  # two chunks of the rule
    want = target.reference_features(ids)  # within fp32 rounding: the regrouped projection weights
    assert (target.features(ids) - want).abs().max() <= 1e-5 * want.abs().max()
    calls = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert calls.count("dflash.chunk_gated_delta_rule.default") == 2  # layers 0 and 2 of the 4 run
    assert not any(isinstance(m, FeatureMixer) for m in target.model.modules())
