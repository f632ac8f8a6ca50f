"""Gated DeltaNet (linear-attention) layers of hybrid targets (Qwen3-Next, Qwen3.5, Qwen3.6) over
a static per-slot state, with exact rollback of rejected draft tokens.

A DeltaNet layer carries two states from token to token instead of keys and values: the last
`K - 1` inputs of its short causal convolution (`conv`, [slots, channels, K - 1]) and the
recurrent matrix of the gated delta rule (`recurrent`, [slots, value heads, key dim, value dim],
fp32 as transformers and flash-linear-attention keep it). Neither can be cut back to a prefix
after the fact, so a step of Q tokens leaves the committed states untouched and writes what
each prefix would leave behind:
- `window` [slots, channels, K - 1 + Q]: the convolution's input, the committed state followed
  by the new tokens; after keeping n of them the state is `window[..., n : n + K - 1]`;
- `steps` [slots, Q, heads, key dim, value dim]: the recurrent state after each new token.

`commit(taken)` then makes each slot's state the one after its first `taken[s]` tokens (0: the
step is forgotten). A step reads only committed states and writes only `window`/`steps`, so
running it again gives the same result: what a CUDA-graph capture needs (its warm-up runs the
function before the replay does), and what makes a rejected draft cost nothing to undo.

The arithmetic is transformers' (`torch_recurrent_gated_delta_rule`: l2-normalised q and k in
fp32, queries scaled by key_dim ** -0.5, decay exp(g), beta-weighted delta update); the
projections, norms and the convolution's weights are the model's own modules. Prefills use the
model's chunked kernel (flash-linear-attention on CUDA when installed) with padding made inert:
beta = 0 and g = 0 past a prompt's end leave the state exactly as the prompt left it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def chunked_rule(mixer: nn.Module, device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The model's own chunked gated-delta-rule function: the kernel transformers picked (fla's,
    when installed) on CUDA; its PyTorch reference elsewhere (fla's Triton kernels cannot read
    CPU tensors)."""
    function = sys.modules[type(mixer).__module__].torch_chunk_gated_delta_rule
    return function if device.type == "cuda" else inspect.unwrap(function)


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
    z = mixer.in_proj_z(x_NQH).reshape(n, q_len, -1, mixer.head_v_dim)
    return mixer.in_proj_qkv(x_NQH), z, mixer.in_proj_b(x_NQH), mixer.in_proj_a(x_NQH)


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


def gated_delta_steps(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    steps_out: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule token by token from `state` [N, Hv, Dk, Dv]: outputs [N, Q, Hv, Dv]
    in value's dtype; the state after token t goes to `steps_out[:, t]` (`state` is not written).
    q, k [N, Q, Hk, Dk] (each key head serves Hv / Hk value heads), v [N, Q, Hv, Dv], g, beta
    [N, Q, Hv]."""
    heads = value.shape[2]
    if query.shape[2] != heads:
        query = query.repeat_interleave(heads // query.shape[2], dim=2)
        key = key.repeat_interleave(heads // key.shape[2], dim=2)
    query, key, value, g, beta = (t.float() for t in (query, key, value, g, beta))
    query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
    key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query / query.shape[-1] ** 0.5
    outputs = []
    for t in range(value.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        k_t = key[:, t]
        remembered = (state * k_t.unsqueeze(-1)).sum(-2)  # what the state returns for k_t
        delta = (value[:, t] - remembered) * beta[:, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * query[:, t].unsqueeze(-1)).sum(-2))
        steps_out[:, t] = state
    return torch.stack(outputs, dim=1)


class DeltaNetStates:
    """Per DeltaNet layer: the committed states of every slot and the last step's candidates
    (see the module docstring), for steps of up to `max_step` tokens."""

    def __init__(
        self,
        mixers: list[nn.Module],
        *,
        slots: int,
        max_step: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.kernel = mixers[0].conv_kernel_size if mixers else 1
        self.conv, self.recurrent, self.window, self.steps = [], [], [], []
        for mixer in mixers:
            channels, width = mixer.conv_dim, self.kernel - 1
            heads, key_dim, value_dim = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
            self.conv.append(torch.zeros((slots, channels, width), dtype=dtype, device=device))
            self.window.append(torch.zeros((slots, channels, width + max_step), dtype=dtype, device=device))
            state = (slots, heads, key_dim, value_dim)
            self.recurrent.append(torch.zeros(state, dtype=torch.float32, device=device))
            self.steps.append(torch.zeros((slots, max_step, *state[1:]), dtype=torch.float32, device=device))
        self.max_step = max_step

    def __len__(self) -> int:
        return len(self.conv)

    def commit(self, taken_S: torch.Tensor) -> None:
        """Each slot's states become those after its first `taken_S[s]` tokens of the last step
        (0 keeps the committed state). Device tensors only: capturable."""
        slots = taken_S.shape[0]
        rows = torch.arange(slots, device=taken_S.device)
        last = (taken_S - 1).clamp(min=0)
        keep_any = (taken_S > 0)[:, None, None, None]
        width = self.kernel - 1
        shift = (taken_S[:, None] + torch.arange(width, device=taken_S.device))[:, None, :]
        for conv, recurrent, window, steps in zip(self.conv, self.recurrent, self.window, self.steps):
            recurrent.copy_(torch.where(keep_any, steps[rows, last], recurrent))
            conv.copy_(window.gather(2, shift.expand(slots, conv.shape[1], width)))


def deltanet_step(
    mixer: nn.Module,
    x_SQH: torch.Tensor,
    conv: torch.Tensor,
    recurrent: torch.Tensor,
    window: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """The mixer's output for Q new tokens of every slot after its committed states; writes the
    candidates (`window`, `steps`), never the committed `conv` / `recurrent`."""
    mixed, z, b, a = project(mixer, x_SQH)
    q_len, width = mixed.shape[1], conv.shape[-1]
    inputs = torch.cat([conv, mixed.transpose(1, 2)], dim=-1)  # [S, C, K - 1 + Q]
    window[:, :, : width + q_len] = inputs
    weight = mixer.conv1d.weight  # [C, 1, K]: depthwise
    mixed = F.conv1d(inputs.to(weight.dtype), weight, mixer.conv1d.bias, groups=inputs.shape[1])
    mixed = F.silu(mixed).to(x_SQH.dtype).transpose(1, 2)
    query, key, value = split_heads(mixer, mixed)
    beta, g = gates(mixer, b, a)
    core = gated_delta_steps(query, key, value, g, beta, recurrent, steps).to(x_SQH.dtype)
    return finish(mixer, core, z)


def deltanet_prefill(
    mixer: nn.Module,
    x_RPH: torch.Tensor,
    last_R: torch.Tensor,
    *,
    rows_R: torch.Tensor,
    conv: torch.Tensor,
    recurrent: torch.Tensor,
) -> torch.Tensor:
    """The mixer's output over right-padded prompts [R, P] from a zero state; slot `rows_R[r]`'s
    committed states become those after token `last_R[r]` (its prompt's last)."""
    mixed, z, b, a = project(mixer, x_RPH)
    prompts, length, channels = mixed.shape
    width = conv.shape[-1]
    padded = F.pad(mixed.transpose(1, 2), (width, 0))  # [R, C, K - 1 + P]: zeros before the prompt
    # Token i sits at padded index i + K - 1: the last K - 1 tokens of a prompt ending at `last`
    # are padded[last + 1 : last + K].
    tail = (last_R[:, None] + 1 + torch.arange(width, device=mixed.device))[:, None, :]
    conv[rows_R] = padded.gather(2, tail.expand(prompts, channels, width)).to(conv.dtype)
    weight = mixer.conv1d.weight  # [C, 1, K]: depthwise
    mixed = F.conv1d(padded.to(weight.dtype), weight, mixer.conv1d.bias, groups=channels)
    mixed = F.silu(mixed).to(x_RPH.dtype).transpose(1, 2)
    query, key, value = split_heads(mixer, mixed)
    beta, g = gates(mixer, b, a)
    real = (torch.arange(length, device=mixed.device) <= last_R[:, None]).unsqueeze(-1)  # [R, P, 1]
    beta, g = beta * real, g * real  # padding writes nothing and decays nothing
    core, final = chunked_rule(mixer, x_RPH.device)(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    recurrent[rows_R] = final.float()
    return finish(mixer, core.to(x_RPH.dtype), z)
