"""Hybrid targets' short convolution on flash-linear-attention's kernel (dflash/target/short_conv.py):
rebound only where it can serve, back on request; on CUDA equal to transformers' reference."""

from __future__ import annotations

import sys

import pytest
import torch

from dflash.target import short_conv
from dflash.target.short_conv import FUNCTION, FlaShortConv, fla_serves, use_fla_short_conv
from tests.test_fp8 import QWEN3_NEXT, tiny_model


def tiny_qwen3_next():
    return tiny_model("qwen3_next", QWEN3_NEXT)


@pytest.fixture
def modeling(monkeypatch):
    """Qwen3-Next's modeling module, its convolution binding restored after the test."""
    import transformers.models.qwen3_next.modeling_qwen3_next as module

    monkeypatch.setattr(module, FUNCTION, getattr(module, FUNCTION))
    return module


def test_the_binding_moves_to_fla_and_back_and_cpu_calls_keep_the_reference(modeling, monkeypatch):
    """With fla available the DeltaNet layers' modeling module calls FlaShortConv, once however
    often it is asked; `enabled=False` puts transformers' function back. On CPU tensors the
    rebound function is transformers' own: the features are identical."""
    model = tiny_qwen3_next()
    ids = torch.randint(0, 256, (2, 19))
    reference = getattr(modeling, FUNCTION)
    with torch.no_grad():
        before = model(ids).logits
    monkeypatch.setattr(short_conv, "fla_available", lambda: True)
    assert use_fla_short_conv(model) == [modeling.__name__]
    assert use_fla_short_conv(model) == [modeling.__name__]
    bound = getattr(modeling, FUNCTION)
    assert isinstance(bound, FlaShortConv) and bound.reference is reference
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    assert use_fla_short_conv(model, enabled=False) == []
    assert getattr(modeling, FUNCTION) is reference


def test_without_fla_nothing_is_rebound(modeling, monkeypatch):
    monkeypatch.setattr(short_conv, "fla_available", lambda: False)
    reference = getattr(modeling, FUNCTION)
    assert use_fla_short_conv(tiny_qwen3_next()) == []
    assert getattr(modeling, FUNCTION) is reference


def test_calls_fla_cannot_serve_exactly_go_to_the_reference():
    """CPU tensors, packed-sequence arguments and other activations reach the function replaced."""
    calls = []

    def reference(hidden_states, weight, bias=None, activation=None, **kwargs):
        calls.append((hidden_states.device.type, activation, kwargs))
        return hidden_states

    conv = FlaShortConv(reference)
    x, w = torch.randn(1, 8, 5), torch.randn(8, 4)
    conv(x, w, None, activation="silu")
    conv(x, w, None, activation="gelu", seq_idx=None)
    assert calls == [("cpu", "silu", {}), ("cpu", "gelu", {"seq_idx": None})]
    packed = torch.zeros(1, 5, dtype=torch.int32)
    assert not fla_serves("silu", {"seq_idx": packed})
    assert not fla_serves("silu", {"cu_seq_lens_q": packed})
    assert not fla_serves("gelu", {})
    if torch.cuda.is_available():
        conv(x.cuda(), w.cuda(), None, activation="silu", seq_idx=packed.cuda())
        assert len(calls) == 3


def test_the_keywords_a_deltanet_layer_forwards_leave_the_call_to_fla(modeling, monkeypatch):
    """The model's flags that a decoder layer forwards to the convolution (`use_cache`,
    `output_hidden_states`, ...) describe no packed sequences: fla's kernel serves the feature
    forward's calls. (Counting every non-None keyword as packing kept every call on the
    reference, 1.9 ms instead of 0.2-0.4 ms per DeltaNet layer at Qwen3-Next-80B's shape.)"""
    from dflash.target.model import FrozenTarget

    calls = []
    reference = getattr(modeling, FUNCTION)

    def recording(hidden_states, weight, bias=None, activation=None, **kwargs):
        calls.append((activation, kwargs))
        return reference(hidden_states, weight, bias, activation=activation, **kwargs)

    monkeypatch.setattr(modeling, FUNCTION, recording)
    target = FrozenTarget(tiny_qwen3_next(), [1, 3])
    with torch.no_grad():
        target.features(torch.randint(0, 256, (2, 19)))
    assert calls, "the feature forward never reached the short convolution"
    for activation, kwargs in calls:
        assert fla_serves(activation, kwargs), kwargs


def test_a_target_built_on_the_cpu_leaves_the_binding_alone(make_cfg, modeling):
    from dflash.config.typed import typed_config
    from dflash.run.inputs import frozen_target

    reference = getattr(modeling, FUNCTION)
    overrides = ["target=qwen3_next_80b_random", *(f"target.arch.{k}={v}" for k, v in QWEN3_NEXT.items())]
    overrides += ["drafter=tiny", "drafter.mask_token_id=255", "drafter.target_layer_ids=[0,3]"]
    frozen_target(typed_config(make_cfg(overrides)), "cpu")
    assert getattr(modeling, FUNCTION) is reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_on_cuda_fla_short_conv_computes_transformers_reference(modeling, dtype, tolerance):
    """[batch, channels, time] in and out as transformers calls it, with and without bias and
    activation, a partial first window (time < kernel) included."""
    pytest.importorskip("fla")
    reference = getattr(modeling, FUNCTION)
    conv = FlaShortConv(reference)
    generator = torch.Generator().manual_seed(0)
    for time_steps in (3, 97):
        x = torch.randn(2, 256, time_steps, generator=generator).to("cuda", dtype)
        w = torch.randn(256, 4, generator=generator).to("cuda", dtype) / 2
        for bias in (None, torch.randn(256, generator=generator).to("cuda", dtype)):
            for activation in (None, "silu"):
                got = conv(x, w, bias, activation=activation)
                want = reference(x, w, bias, activation=activation)
                assert got.shape == want.shape and got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
def test_on_cuda_a_hybrid_target_on_fla_short_conv_gives_the_same_features(make_cfg, modeling, monkeypatch):
    """target.fla_short_conv true vs false on a Qwen3-Next-layout target in fp32: the same
    features within fp32 rounding, and the modeling module bound accordingly."""
    pytest.importorskip("fla")
    from dflash.config.typed import typed_config
    from dflash.run.inputs import frozen_target

    base = ["target=qwen3_next_80b_random", *(f"target.arch.{k}={v}" for k, v in QWEN3_NEXT.items())]
    base += ["drafter=tiny", "drafter.mask_token_id=255", "drafter.target_layer_ids=[0,3]", "gpu=single"]
    base += ["target.dtype=float32"]
    ids = torch.randint(0, 256, (2, 80), device="cuda")
    import fla.modules.causal_conv1d as fla_conv

    kernel_calls = []
    kernel = fla_conv.causal_conv1d

    def counting(*args, **kwargs):
        kernel_calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fla_conv, "causal_conv1d", counting)
    features, calls = {}, {}
    for enabled in ("false", "true"):
        target, _ = frozen_target(typed_config(make_cfg(base + [f"target.fla_short_conv={enabled}"])), "cuda")
        assert isinstance(getattr(sys.modules[modeling.__name__], FUNCTION), FlaShortConv) == (
            enabled == "true"
        )
        kernel_calls.clear()
        features[enabled] = target.features(ids)
        calls[enabled] = len(kernel_calls)
    deltanet_layers = sum(t == "linear_attention" for t in target.config.layer_types)
    assert calls == {"false": 0, "true": deltanet_layers}  # every DeltaNet layer on fla's kernel
    torch.testing.assert_close(features["true"], features["false"], rtol=1e-4, atol=1e-4)
