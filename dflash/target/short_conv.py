"""Hybrid targets' short causal convolution on flash-linear-attention's Triton kernel.

A Gated DeltaNet layer (Qwen3-Next, Qwen3.5 / Qwen3.6) runs a depthwise causal convolution of
kernel 4 over its q/k/v channels before the recurrence. transformers calls it through a module
function, `causal_conv1d_fn`, bound at import to the `causal-conv1d` package when that is
installed and otherwise to a PyTorch reference (F.conv1d with padding, then the activation),
with the warning "`causal_conv1d_fn` is falling back to its reference PyTorch implementation".
flash-linear-attention, which the same layers already use for the chunked delta rule, ships a
Triton causal convolution; transformers does not look there. At Qwen3-Next-80B's shape
([4, 3072, 8192], kernel 4, bf16, one H200) the reference takes 1.946 ms and fla's kernel
0.197 ms (benchmarks/RESULTS.md, 2026-12-03), once per DeltaNet layer per forward.

`use_fla_short_conv(model)` rebinds that module function, for the modeling modules the model's
DeltaNet layers come from, to `FlaShortConv`: the same contract ([batch, channels, time] in and
out, weight [channels, kernel], optional bias and activation) on fla's kernel, which reads
[batch, time, channels] (the layer's own layout before its transpose, so no copy). Calls it
cannot serve exactly as asked (CPU tensors, packed-sequence arguments) go to the function it
replaced. Feature forwards only: the static decoder keeps its own convolution state
(dflash/decoding/deltanet.py).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn

from dflash.target.families import is_deltanet_layer
from dflash.torch_runtime.kernel_libraries import installed

FUNCTION = "causal_conv1d_fn"  # the module function transformers' DeltaNet forward calls
# Arguments that describe packed sequences (several sequences in one row): fla's kernel would
# convolve across their boundaries as called here, so such calls keep the reference. Every other
# keyword the layer forwards (`use_cache`, `output_hidden_states`, ... : the model's flags, which
# the reference ignores too) says nothing about the convolution.
PACKED_SEQUENCE_ARGUMENTS = ("seq_idx", "cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k")


def fla_available() -> bool:
    return installed("fla")


def fla_serves(activation: str | None, kwargs: dict) -> bool:
    """Whether fla's kernel computes exactly what the reference would for a call with this
    activation and these keyword arguments (the tensors' device aside)."""
    packed = any(kwargs.get(name) is not None for name in PACKED_SEQUENCE_ARGUMENTS)
    return not packed and activation in (None, "silu", "swish")


def fla_causal_conv(
    x_NTC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """fla's causal convolution of [N, T, C] (its own layout), in `x_NTC`'s dtype; the calls
    `fla_serves` admits."""
    from fla.modules.causal_conv1d import causal_conv1d

    out, _ = causal_conv1d(x_NTC, weight_CK.to(x_NTC.dtype), bias_C, activation=activation)
    return out


def reference_conv(module: str) -> Callable[..., torch.Tensor]:
    """The PyTorch reference of `causal_conv1d_fn` in the modeling module `module` ([N, C, T] in
    and out), whatever the name is bound to now (FlaShortConv, transformers' kernel wrapper)."""
    function = getattr(sys.modules[module], FUNCTION)
    if isinstance(function, FlaShortConv):
        function = function.reference
    return inspect.unwrap(function)


class FlaShortConv:
    """transformers' `causal_conv1d_fn` contract on fla's kernel; `reference` serves the rest."""

    def __init__(self, reference: Callable[..., torch.Tensor]):
        self.reference = reference

    def __call__(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if not (hidden_states.is_cuda and fla_serves(activation, kwargs)):
            return self.reference(hidden_states, weight, bias, activation=activation, **kwargs)
        return fla_causal_conv(hidden_states.transpose(1, 2), weight, bias, activation).transpose(1, 2)


def use_fla_short_conv(model: nn.Module, enabled: bool = True) -> list[str]:
    """Rebind `causal_conv1d_fn` to fla's kernel (enabled, and fla installed) or back to the
    function it replaced, in the modeling modules of `model`'s DeltaNet layers; the binding is
    the module's, so it holds for every model of that family in the process. Returns the
    modules now on fla's kernel."""
    modules = {type(layer.linear_attn).__module__ for layer in model.modules() if is_deltanet_layer(layer)}
    using = []
    for name in sorted(modules):
        module = sys.modules.get(name)
        current = getattr(module, FUNCTION, None)
        if current is None:  # a transformers release that calls it otherwise: left alone
            continue
        if not (enabled and fla_available()):
            if isinstance(current, FlaShortConv):
                setattr(module, FUNCTION, current.reference)
            continue
        if not isinstance(current, FlaShortConv):
            setattr(module, FUNCTION, FlaShortConv(current))
        using.append(name)
    return using
