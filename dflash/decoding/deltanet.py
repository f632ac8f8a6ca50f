"""Gated DeltaNet (linear-attention) layers of hybrid targets (Qwen3-Next, Qwen3.5, Qwen3.6) over
a static per-slot state, with exact rollback of rejected draft tokens.

A DeltaNet layer carries two states from token to token instead of keys and values: the last
`K - 1` inputs of its short causal convolution (`conv`, [slots, channels, K - 1]) and the
recurrent matrix of the gated delta rule (`recurrent`, [slots, value heads, key dim, value dim],
fp32 as transformers and flash-linear-attention keep it). Neither can be cut back to a prefix
after the fact, so a step of Q tokens leaves the committed states untouched and keeps what a
prefix needs to be replayed:
- `window` [slots, channels, K - 1 + Q]: the convolution's input, the committed state followed
  by the new tokens; after keeping n of them the state is `window[..., n : n + K - 1]`;
- `mixed` [slots, Q, channels] and `gates` [slots, Q, 2, value heads]: the rule's inputs (q, k, v
  after the convolution; beta and the log decay g), a few KB per token.

`commit(taken)` then runs the rule once more from the committed state over each slot's first
`taken[s]` tokens (the rest made inert: beta = 0 writes nothing, g = 0 decays nothing, so the
state passes them unchanged, bit for bit) and keeps the result (0: the step is forgotten). A step
reads only committed states and writes only the candidates, so running it again gives the same
result: what a CUDA-graph capture needs (its warm-up runs the function before the replay does),
and what makes a rejected draft cost nothing to undo.

The rule is the model's own token-by-token kernel (`recurrent_rule`: flash-linear-attention's
fused recurrent kernel on CUDA when installed, one launch per layer for all Q tokens; transformers'
PyTorch loop elsewhere), behind one custom op so a compiled layer keeps it whole. Replaying a
prefix with the same kernel and inputs reproduces the state the step itself reached after those
tokens, the one its outputs (the verified logits) were computed from. An earlier version kept the state
after every token instead ([slots, Q, heads, key dim, value dim] fp32 per layer, 16x the state)
and updated it with Q rounds of elementwise kernels per layer, the bulk of a hybrid verify's
launches. The projections, norms and the convolution's weights are the model's own modules.
Prefills use the chunked rule of the feature forwards (`chunked_delta_rule`: flash-linear-attention
on CUDA when installed, the model's PyTorch reference elsewhere) with padding made inert the same
way: beta = 0 and g = 0 past a prompt's end.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dflash.target.deltanet_mixer import chunked_delta_rule, finish, gates, project, split_heads


def recurrent_rule(module: str, device: torch.device) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The modeling module's token-by-token gated-delta-rule function (fla's fused recurrent
    kernel on CUDA when installed); its PyTorch reference elsewhere (fla's Triton kernels cannot
    read CPU tensors)."""
    function = sys.modules[module].torch_recurrent_gated_delta_rule
    return function if device.type == "cuda" else inspect.unwrap(function)


@torch.library.custom_op("dflash::gated_delta_recurrence", mutates_args=())
def gated_delta_recurrence(
    mixed: torch.Tensor, gates: torch.Tensor, state: torch.Tensor, key_dim: int, heads_k: int, module: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over Q tokens of every slot from `state` [N, Hv, Dk, Dv] (not
    written): outputs [N, Q, Hv, Dv] in `mixed`'s dtype and the state after the last token.
    `mixed` [N, Q, 2 * Hk * Dk + Hv * Dv] holds q, k, v after the convolution; `gates` [N, Q, 2,
    Hv] fp32 holds beta, then g. q and k are l2-normalised in the kernel, as the models do."""
    n, q_len, _ = mixed.shape
    heads_v = gates.shape[-1]
    query, key, value = torch.split(mixed, [key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    head_k = key_dim // heads_k
    out, final = recurrent_rule(module, mixed.device)(
        query.reshape(n, q_len, heads_k, head_k),
        key.reshape(n, q_len, heads_k, head_k),
        value.reshape(n, q_len, heads_v, -1),
        g=gates[:, :, 1],
        beta=gates[:, :, 0],
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out.to(mixed.dtype), final.float()


@gated_delta_recurrence.register_fake
def _(mixed, gates, state, key_dim, heads_k, module):
    n, q_len, channels = mixed.shape
    heads_v, value_dim = state.shape[1], state.shape[-1]
    return mixed.new_empty((n, q_len, heads_v, value_dim)), torch.empty_like(state)


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
        self.mixers = mixers
        self.kernel = mixers[0].conv_kernel_size if mixers else 1
        self.conv, self.recurrent, self.window, self.mixed, self.gates = [], [], [], [], []
        for mixer in mixers:
            channels, width = mixer.conv_dim, self.kernel - 1
            heads, key_dim, value_dim = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
            self.conv.append(torch.zeros((slots, channels, width), dtype=dtype, device=device))
            self.window.append(torch.zeros((slots, channels, width + max_step), dtype=dtype, device=device))
            self.recurrent.append(
                torch.zeros((slots, heads, key_dim, value_dim), dtype=torch.float32, device=device)
            )
            self.mixed.append(torch.zeros((slots, max_step, channels), dtype=dtype, device=device))
            self.gates.append(torch.zeros((slots, max_step, 2, heads), dtype=torch.float32, device=device))
        self.max_step = max_step

    def __len__(self) -> int:
        return len(self.conv)

    def commit(self, taken_S: torch.Tensor) -> None:
        """Each slot's states become those after its first `taken_S[s]` tokens of the last step
        (0 keeps the committed state). Device tensors only: capturable."""
        slots = taken_S.shape[0]
        width = self.kernel - 1
        shift = (taken_S[:, None] + torch.arange(width, device=taken_S.device))[:, None, :]
        # A captured commit replays every buffered token (masked); eagerly on the CPU, where reading
        # `taken` costs nothing, only as many as the longest kept prefix (a plain step keeps one
        # token of a decoder sized for 16-token verifications).
        replay = self.max_step if taken_S.is_cuda else max(int(taken_S.max()), 1)
        kept = (torch.arange(replay, device=taken_S.device) < taken_S[:, None])[:, :, None, None]
        for index, mixer in enumerate(self.mixers):
            conv, recurrent = self.conv[index], self.recurrent[index]
            _, final = gated_delta_recurrence(
                self.mixed[index][:, :replay],
                self.gates[index][:, :replay] * kept,  # tokens past `taken` write nothing and decay nothing
                recurrent,
                key_dim=mixer.key_dim,
                heads_k=mixer.num_k_heads,
                module=type(mixer).__module__,
            )
            recurrent.copy_(final)
            conv.copy_(self.window[index].gather(2, shift.expand(slots, conv.shape[1], width)))


def deltanet_step(
    mixer: nn.Module,
    x_SQH: torch.Tensor,
    *,
    conv: torch.Tensor,
    recurrent: torch.Tensor,
    window: torch.Tensor,
    mixed_buffer: torch.Tensor,
    gates_buffer: torch.Tensor,
) -> torch.Tensor:
    """The mixer's output for Q new tokens of every slot after its committed states; writes the
    candidates (`window`, the rule's inputs), never the committed `conv` / `recurrent`."""
    mixed, z, b, a = project(mixer, x_SQH)
    q_len, width = mixed.shape[1], conv.shape[-1]
    inputs = torch.cat([conv, mixed.transpose(1, 2)], dim=-1)  # [S, C, K - 1 + Q]
    window[:, :, : width + q_len] = inputs
    weight = mixer.conv1d.weight  # [C, 1, K]: depthwise
    mixed = F.conv1d(inputs.to(weight.dtype), weight, mixer.conv1d.bias, groups=inputs.shape[1])
    mixed_buffer[:, :q_len] = F.silu(mixed).to(x_SQH.dtype).transpose(1, 2)
    beta, g = gates(mixer, b, a)
    gates_buffer[:, :q_len] = torch.stack([beta.float(), g], dim=2)
    # The rule reads the buffers just written, as `commit` will: the same inputs, the same bits.
    core, _ = gated_delta_recurrence(
        mixed_buffer[:, :q_len],
        gates_buffer[:, :q_len],
        recurrent,
        key_dim=mixer.key_dim,
        heads_k=mixer.num_k_heads,
        module=type(mixer).__module__,
    )
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
    core, final = chunked_delta_rule(
        query, key, value, g, beta, module=type(mixer).__module__, output_final_state=True
    )
    recurrent[rows_R] = final.float()
    return finish(mixer, core.to(x_RPH.dtype), z)
