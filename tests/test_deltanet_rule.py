"""The gated delta rule of the static decoder's DeltaNet layers (dflash.decoding.deltanet):
`gated_delta_recurrence` against the rule written out token by token, grouped value heads
included, and the inert tokens a commit relies on (beta = 0, g = 0 leave the state exactly as it
was). On CUDA the same op runs flash-linear-attention's fused recurrent kernel (GPU test)."""

from __future__ import annotations

import pytest
import torch
import transformers.models.qwen3_next.modeling_qwen3_next as modeling

from dflash.decoding.deltanet import gated_delta_recurrence

MODULE = modeling.__name__  # whose rule the op calls, as a layer's own module is
HEADS_K, HEADS_V, HEAD_K, HEAD_V = 2, 4, 8, 6  # each key head serves two value heads


def written_out(mixed, gates, state):
    """The rule per token: S <- S exp(g); S <- S + beta k (v - S^T k)^T; o = S^T q, with q and k
    l2-normalised and q scaled by 1 / sqrt(head dim); state [N, Hv, Dk, Dv]."""
    n, q_len, _ = mixed.shape
    key_dim = HEADS_K * HEAD_K
    q, k, v = torch.split(mixed.double(), [key_dim, key_dim, HEADS_V * HEAD_V], dim=-1)
    q, k = (t.reshape(n, q_len, HEADS_K, HEAD_K) for t in (q, k))
    q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / HEAD_K**0.5
    q, k = (t.repeat_interleave(HEADS_V // HEADS_K, dim=2) for t in (q, k))
    v = v.reshape(n, q_len, HEADS_V, HEAD_V)
    beta, g = gates.double().unbind(2)
    state, outputs = state.double(), []
    for t in range(q_len):
        state = state * g[:, t].exp()[..., None, None]
        error = v[:, t] - torch.einsum("nhkv,nhk->nhv", state, k[:, t])
        state = state + beta[:, t, :, None, None] * torch.einsum("nhk,nhv->nhkv", k[:, t], error)
        outputs.append(torch.einsum("nhkv,nhk->nhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def inputs(device="cpu", q_len=5, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    channels = 2 * HEADS_K * HEAD_K + HEADS_V * HEAD_V
    mixed = torch.randn(2, q_len, channels, generator=generator).to(device, dtype)
    beta = torch.rand(2, q_len, HEADS_V, generator=generator)
    g = -torch.rand(2, q_len, HEADS_V, generator=generator)
    gates = torch.stack([beta, g], dim=2).to(device)
    state = torch.randn(2, HEADS_V, HEAD_K, HEAD_V, generator=generator).to(device)
    return mixed, gates, state


def recurrence(mixed, gates, state):
    return gated_delta_recurrence(
        mixed, gates, state, key_dim=HEADS_K * HEAD_K, heads_k=HEADS_K, module=MODULE
    )


def test_the_recurrence_is_the_rule_written_out_with_grouped_value_heads():
    mixed, gates, state = inputs()
    before = state.clone()
    out, final = recurrence(mixed, gates, state)
    want_out, want_final = written_out(mixed, gates, state)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), want_final, atol=1e-5, rtol=1e-5)
    assert torch.equal(state, before)  # the committed state is only read


def inert_tail_leaves_the_state_exactly(device):
    """Tokens with beta = 0 and g = 0 after the first two: the final state is, bit for bit, the
    state after those two (what `commit` relies on to keep a prefix of a step)."""
    mixed, gates, state = inputs(device)
    _, after_two = recurrence(mixed[:, :2].contiguous(), gates[:, :2].contiguous(), state)
    kept = (torch.arange(gates.shape[1], device=device) < 2)[None, :, None, None]
    _, masked = recurrence(mixed, gates * kept, state)
    assert torch.equal(masked, after_two)


def test_tokens_with_no_write_and_no_decay_leave_the_state_bit_for_bit():
    inert_tail_leaves_the_state_exactly("cpu")


@pytest.mark.gpu
def test_on_cuda_the_fused_recurrent_kernel_computes_the_rule():
    pytest.importorskip("fla")
    mixed, gates, state = inputs("cuda")
    out, final = recurrence(mixed, gates, state)
    want_out, want_final = written_out(mixed.cpu(), gates.cpu(), state.cpu())
    torch.testing.assert_close(out.double().cpu(), want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final.double().cpu(), want_final, atol=1e-4, rtol=1e-4)
    inert_tail_leaves_the_state_exactly("cuda")
