"""Hybrid targets' Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5 / Qwen3.6): its parts as the
models compute them, and a feature-forward mixer that the regional compile keeps whole.

A DeltaNet layer projects each token to q, k, v (one "mixed" channel vector), an output gate z
and the rule's gate inputs b, a; runs a depthwise causal convolution of kernel 4 over the mixed
channels; runs the gated delta rule over the sequence; then a gated RMSNorm and the output
projection. transformers' forward does this with flash-linear-attention's kernels where they
are installed, but dynamo cannot compile it as is: it traces the PyTorch reference of the
chunked rule instead (a loop over 64-token chunks it unrolls), so the regional compile used to
leave the whole token mixer eager, and with it a dozen elementwise kernels per layer (the
transposes and copies around the convolution, the gates in fp32, q and k repeated to the value
heads, the gated norm in fp32).

`FeatureMixer` runs the same computation with the two kernels as custom ops (`dflash::short_conv`,
`dflash::chunk_gated_delta_rule`), which dynamo keeps opaque: the layer compiles whole and
inductor fuses what lies between them. On CUDA with fla installed the ops are fla's Triton
kernels (the rule reading q and k at their own head count: fla pairs key heads with groups of
value heads itself, so they are not repeated); elsewhere the PyTorch reference transformers
would run. Feature forwards only (no cache, no packed sequences); `compile_features` (either
scope) installs it in the compiled copies of the layers, so `reference_features` and decoding
keep transformers' own forward, which the tests compare it with.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.target.fp8 import BlockFP8Linear
from dflash.target.short_conv import fla_causal_conv, fla_serves, reference_conv
from dflash.torch_runtime.kernel_libraries import fla_runs


def project(mixer: nn.Module, x_NQH: torch.Tensor):
    """The convolution's input [N, Q, C] (C = 2 key dims + value dim: q, k, v), the output gate
    z [N, Q, Hv, Dv], and b, a [N, Q, Hv], for both published projection layouts: Qwen3-Next's
    fused `in_proj_qkvz` / `in_proj_ba` (heads interleaved per key group) and Qwen3.5's separate
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`."""
    n, q_len, _ = x_NQH.shape
    if hasattr(mixer, "in_proj_qkvz"):
        query, key, value, z, b, a = mixer.fix_query_key_value_ordering(
            mixer.in_proj_qkvz(x_NQH), mixer.in_proj_ba(x_NQH)
        )
        qkv = torch.cat([t.reshape(n, q_len, -1) for t in (query, key, value)], dim=-1)
        return qkv, z, b, a
    return mixer.in_proj_qkv(x_NQH), *project_z_b_a(mixer, x_NQH)


def linear_weights(linear: nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's weight [out, in] in `dtype` and its bias: an FP8 layer's dequantized."""
    if isinstance(linear, BlockFP8Linear):
        return linear.dequantized(dtype), linear.bias
    return linear.weight.to(dtype), linear.bias


def grouped_rows(linear: nn.Module, dtype: torch.dtype, *, groups: int, widths: list[int]) -> list[tuple]:
    """A projection whose output rows come in `groups` groups, each the concatenation of parts of
    `widths` rows, regrouped part by part: for each part, its rows of every group in group
    order, as (weight, bias). Projecting with them gives each part contiguous, in the order the
    model's reshapes produce, with no gather of the projected activations."""
    weight, bias = linear_weights(linear, dtype)
    parts = torch.split(weight.view(groups, sum(widths), -1), widths, dim=1)
    biases = torch.split(bias.view(groups, -1), widths, dim=1) if bias is not None else [None] * len(widths)
    return [
        (w.reshape(-1, weight.shape[1]), None if b is None else b.reshape(-1)) for w, b in zip(parts, biases)
    ]


def project_parts(mixer: nn.Module, x_NQH: torch.Tensor):
    """The convolution's input as three contiguous parts, q [N, Q, Hk * Dk], k (the same) and
    v [N, Q, Hv * Dv], with z [N, Q, Hv, Dv] and b, a [N, Q, Hv]: each part projected by its own
    rows of the weights. Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` interleave the parts per key
    group; the model projects, then regroups the projected activations (on an H200, Qwen3-Next-80B's
    shape at 4 x 3072 tokens, 0.71 ms per layer for that copy as compiled: [12288, 8192]). Here the
    weight rows are regrouped instead, a copy of the [12288, 2048] weight per forward (fused into
    an FP8 layer's dequantization), and no regrouped copy is kept beside the model's weights.
    Separate parts also reach fla's rule contiguous (it copies a strided q, k or v). Qwen3.5's
    `in_proj_qkv` is already in order: its row slices are views."""
    if hasattr(mixer, "in_proj_qkvz"):
        n, q_len, _ = x_NQH.shape
        ratio = mixer.num_v_heads // mixer.num_k_heads
        value_width = ratio * mixer.head_v_dim
        q, k, v, z = grouped_rows(
            mixer.in_proj_qkvz,
            x_NQH.dtype,
            groups=mixer.num_k_heads,
            widths=[mixer.head_k_dim, mixer.head_k_dim, value_width, value_width],
        )
        b, a = grouped_rows(mixer.in_proj_ba, x_NQH.dtype, groups=mixer.num_k_heads, widths=[ratio, ratio])
        ba = F.linear(x_NQH, torch.cat([b[0], a[0]]), None if b[1] is None else torch.cat([b[1], a[1]]))
        parts = [F.linear(x_NQH, *part) for part in (q, k, v)]
        z_NQHD = F.linear(x_NQH, *z).view(n, q_len, -1, mixer.head_v_dim)
        return parts, z_NQHD, ba[..., : mixer.num_v_heads], ba[..., mixer.num_v_heads :]
    weight, bias = linear_weights(mixer.in_proj_qkv, x_NQH.dtype)
    widths = [mixer.key_dim, mixer.key_dim, mixer.value_dim]
    biases = torch.split(bias, widths) if bias is not None else [None] * 3
    parts = [F.linear(x_NQH, w, b) for w, b in zip(torch.split(weight, widths), biases)]
    return parts, *project_z_b_a(mixer, x_NQH)


def project_z_b_a(mixer: nn.Module, x_NQH: torch.Tensor):
    """Qwen3.5's separate projections of the output gate z [N, Q, Hv, Dv] and of b, a [N, Q, Hv]."""
    n, q_len, _ = x_NQH.shape
    z = mixer.in_proj_z(x_NQH).reshape(n, q_len, -1, mixer.head_v_dim)
    return z, mixer.in_proj_b(x_NQH), mixer.in_proj_a(x_NQH)


def split_heads(mixer: nn.Module, mixed_NQC: torch.Tensor):
    n, q_len, _ = mixed_NQC.shape
    query, key, value = torch.split(mixed_NQC, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    return (
        query.reshape(n, q_len, -1, mixer.head_k_dim),
        key.reshape(n, q_len, -1, mixer.head_k_dim),
        value.reshape(n, q_len, -1, mixer.head_v_dim),
    )


def gates(mixer: nn.Module, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """beta (how much a token writes) and g (log decay), as the model computes them."""
    return b.sigmoid(), -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)


def finish(mixer: nn.Module, core_NQHD: torch.Tensor, z_NQHD: torch.Tensor) -> torch.Tensor:
    """The gated RMSNorm and the output projection."""
    n, q_len = core_NQHD.shape[:2]
    normed = mixer.norm(core_NQHD.reshape(-1, mixer.head_v_dim), z_NQHD.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(normed.reshape(n, q_len, -1))


@torch.library.custom_op("dflash::short_conv", mutates_args=())
def short_conv(
    x_NTC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None, activation: str, module: str
) -> torch.Tensor:
    """The depthwise causal convolution over time of [N, T, C] (zeros before the first token),
    then `activation` (the config's name, "" for none), in `x_NTC`'s dtype: fla's kernel where it
    runs, else the PyTorch reference of the modeling module `module`."""
    act = activation or None
    if fla_runs(x_NTC.device) and fla_serves(act, {}):
        return fla_causal_conv(x_NTC, weight_CK, bias_C, act)
    out = reference_conv(module)(x_NTC.transpose(1, 2), weight_CK, bias_C, activation=act)
    return out.transpose(1, 2).contiguous()


@short_conv.register_fake
def _(x_NTC, weight_CK, bias_C, activation, module):
    return torch.empty_like(x_NTC)


def chunked_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    module: str,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole sequences from a zero state, q and k l2-normalised in the
    kernel as the models do: q, k [N, T, Hk, Dk], v [N, T, Hv, Dv], g, beta [N, T, Hv] -> the
    outputs [N, T, Hv, Dv] and the state after the last token (or None). fla's chunked kernel
    where it runs (it pairs each key head with its group of value heads); elsewhere the PyTorch
    reference of the modeling module `module`, which pairs heads one to one, so q and k are
    repeated to the value heads first. Feature forwards and the static decoder's prefills."""
    if fla_runs(value.device):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

        return fla_rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=True,
        )
    groups = value.shape[2] // query.shape[2]
    if groups > 1:
        query, key = (t.repeat_interleave(groups, dim=2) for t in (query, key))
    reference = inspect.unwrap(sys.modules[module].torch_chunk_gated_delta_rule)
    return reference(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True,
    )


@torch.library.custom_op("dflash::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    module: str,
) -> torch.Tensor:
    """`chunked_delta_rule`'s outputs in `value`'s dtype, as one op dynamo keeps whole."""
    out, _ = chunked_delta_rule(query, key, value, g, beta, module=module, output_final_state=False)
    return out.to(value.dtype)


@chunk_gated_delta_rule.register_fake
def _(query, key, value, g, beta, module):
    return torch.empty_like(value)


class FeatureMixer(nn.Module):
    """A DeltaNet layer's token mixer for feature forwards: the model's own weights and parts
    (`project`, `gates`, `finish`), the convolution and the rule as the custom ops above."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer
        self._modeling = type(mixer).__module__

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if cache_params is not None or kwargs.get("cu_seq_lens_q") is not None:
            raise ValueError("FeatureMixer serves feature forwards: no cache, no packed sequences")
        mixer = self.mixer
        # padding positions zeroed before the projections, as the model does
        hidden_states = sys.modules[self._modeling].apply_mask_to_padding_states(
            hidden_states, attention_mask
        )
        parts, z, b, a = project_parts(mixer, hidden_states)
        # The depthwise convolution part by part (each channel is its own): contiguous outputs
        widths = [mixer.key_dim, mixer.key_dim, mixer.value_dim]
        weights = torch.split(mixer.conv1d.weight.squeeze(1), widths)
        biases = torch.split(mixer.conv1d.bias, widths) if mixer.conv1d.bias is not None else [None] * 3
        n, q_len, _ = hidden_states.shape
        query, key, value = (
            short_conv(part, weight, bias, mixer.activation or "", self._modeling).view(n, q_len, -1, dim)
            for part, weight, bias, dim in zip(
                parts, weights, biases, (mixer.head_k_dim, mixer.head_k_dim, mixer.head_v_dim)
            )
        )
        beta, g = gates(mixer, b, a)
        core = chunk_gated_delta_rule(query, key, value, g, beta, self._modeling)
        return finish(mixer, core, z)
