"""The Gated DeltaNet token mixer of feature forwards (dflash/target/deltanet_mixer.py, `FeatureMixer`):
transformers' mixer's output, exactly where both run PyTorch; its two kernels opaque to dynamo, so
a compiled layer keeps them whole; on CUDA, flash-linear-attention's kernels against the
reference."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.target.deltanet_mixer import FeatureMixer
from dflash.target.families import is_deltanet_layer
from dflash.target.fp8 import BlockFP8Linear, quantize_layer
from dflash.target.model import FrozenTarget

HYBRID_FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]  # both projection layouts, dense and MoE


def deltanet_mixers(model) -> list[torch.nn.Module]:
    return [layer.linear_attn for layer in model.base_model.layers if is_deltanet_layer(layer)]


@pytest.mark.parametrize(
    "family, fp8", [("qwen3_next", False), ("qwen3_next", True), ("qwen3_5", False), ("qwen3_5_moe", False)]
)
def test_the_feature_mixer_gives_transformers_mixer_output(family, fp8, request):
    """fp32 on the CPU, with a padding mask (padded positions zeroed before the projections, as
    the model does) and without: bit for bit the output of the model's own mixer where the
    projections are the model's own (Qwen3.5's layout); within fp32 rounding where the feature
    mixer projects with Qwen3-Next's interleaved weights regrouped (another GEMM blocking), block
    FP8 projections (dequantized as they run) included. A regrouping that put one row of q, k,
    v, z, b or a out of place would be off by the size of the output."""
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(f"tiny_{family}_dir")).eval()
    if fp8:
        for layer in model.base_model.layers:
            quantize_layer(layer)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 23, model.config.get_text_config().hidden_size, generator=generator)
    mask = torch.ones(2, 23, dtype=torch.long)
    mask[1, :5] = 0  # a left-padded row
    mixers = deltanet_mixers(model)
    assert mixers
    assert isinstance(
        mixers[0].in_proj_qkvz if fp8 else mixers[0], BlockFP8Linear if fp8 else torch.nn.Module
    )
    with torch.no_grad():
        for mixer in mixers:
            for attention_mask in (None, mask):
                want = mixer(hidden, attention_mask=attention_mask)
                got = FeatureMixer(mixer)(hidden, attention_mask=attention_mask)
                if family == "qwen3_next":
                    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
                else:
                    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_cache_or_packed_sequences_are_refused(tiny_qwen3_next_dir):
    mixer = FeatureMixer(deltanet_mixers(AutoModelForCausalLM.from_pretrained(tiny_qwen3_next_dir))[0])
    hidden = torch.zeros(1, 3, mixer.mixer.hidden_size)
    with pytest.raises(ValueError, match="no cache, no packed sequences"):
        mixer(hidden, cache_params=object())
    with pytest.raises(ValueError, match="no cache, no packed sequences"):
        mixer(hidden, cu_seq_lens_q=torch.tensor([0, 3]))


def test_a_compiled_layer_keeps_the_convolution_and_the_rule_whole(tiny_qwen3_next_dir):
    """The graph dynamo captures of a DeltaNet layer's feature mixer holds the kernels as whole
    calls (dflash::short_conv once for each of q, k, v; dflash::chunk_gated_delta_rule once),
    not the reference's unrolled loop over 64-token chunks, and no graph break."""
    from torch._dynamo.utils import counters

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_next_dir).eval()
    mixer = FeatureMixer(deltanet_mixers(model)[0])
    graphs = []

    def capture(graph, inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    counters.clear()
    hidden = torch.randn(2, 150, model.config.hidden_size)  # three chunks of the rule
    with torch.no_grad():
        got = torch.compile(mixer, backend=capture, fullgraph=True)(hidden)
        torch.testing.assert_close(got, mixer(hidden), rtol=0, atol=0)
    assert len(graphs) == 1 and sum(counters["graph_break"].values()) == 0
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert targets.count("dflash.short_conv.default") == 3, targets  # q, k and v: contiguous each
    assert targets.count("dflash.chunk_gated_delta_rule.default") == 1, targets
    assert len(targets) < 60, f"{len(targets)} calls: the rule's loop was traced"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family, dtype, backend",
    [
        ("qwen3_next", torch.float32, "aot_eager"),
        ("qwen3_next", torch.bfloat16, "inductor"),
        ("qwen3_5_moe", torch.bfloat16, "inductor"),  # the other projection layout
    ],
)
def test_on_cuda_the_compiled_layers_on_fla_give_the_eager_stacks_features(
    family, dtype, backend, monkeypatch, request
):
    """Regionally compiled features of a hybrid target, its DeltaNet layers on fla's convolution
    and chunked rule through FeatureMixer, against transformers' eager stack; and fla's kernels
    really ran, once per DeltaNet layer each. fp32 through dynamo and AOTAutograd without
    Inductor's code generation: the eager stack's features within fp32 rounding (a tight bound in
    seconds). bf16 through Inductor, which fuses ops and keeps their intermediates in fp32 where
    the eager stack rounds every op to bf16, so the two bf16 forwards part by bf16 rounding
    compounded over the layers (on an H200 up to 7% of the features' largest value: a fixed bound
    says little): against the same weights run in fp32, the compiled features must be as close as
    transformers' own bf16 features are (within a factor of 2)."""
    pytest.importorskip("fla")
    import fla.modules.causal_conv1d as fla_conv
    import fla.ops.gated_delta_rule as fla_rule

    # The model first: importing its modeling module binds fla's rule there, with a wrapper that
    # passes on only the keywords the bound function's signature names. A counting wrapper bound
    # in its place would lose g and beta for every later test in the process.
    directory = request.getfixturevalue(f"tiny_{family}_dir")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).cuda()
    exact = FrozenTarget(copy.deepcopy(model).float(), [5])  # the bf16 weights, fp32 arithmetic
    calls = {"conv": 0, "rule": 0}

    def counting(name, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(fla_conv, "causal_conv1d", counting("conv", fla_conv.causal_conv1d))
    monkeypatch.setattr(fla_rule, "chunk_gated_delta_rule", counting("rule", fla_rule.chunk_gated_delta_rule))
    target = FrozenTarget(model, [5])
    target.compile_features(backend, scope="layers")
    ids = torch.randint(1, 500, (2, 200), device="cuda")
    want = target.reference_features(ids)
    calls.update(conv=0, rule=0)
    got = target.features(ids)
    deltanet_layers = len(deltanet_mixers(model))
    assert calls == {"conv": 3 * deltanet_layers, "rule": deltanet_layers}  # q, k, v convolved apart
    scale = max(want.abs().max().item(), 1.0)
    if dtype == torch.float32:
        assert (got - want).abs().max().item() <= 2e-4 * scale
        return
    truth = exact.reference_features(ids)
    compiled_error = (got.float() - truth).abs().max().item()
    eager_error = (want.float() - truth).abs().max().item()
    assert compiled_error <= max(2 * eager_error, 1e-2 * scale), (compiled_error, eager_error, scale)
