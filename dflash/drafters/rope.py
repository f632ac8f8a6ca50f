"""Rotary position embeddings as the Llama, Mistral and Qwen families apply them, written once
for the drafter and the static-cache decoder.

transformers routes most families' `apply_rotary_pos_emb` through the `kernels` hub, whose
active-function table a compiled graph that called it would guard on (state shared between
threads while any thread compiles: dflash/torch_runtime/thread_records.py keeps eager threads off it).
Computed here, the drafter's and the decoder's graphs read no library dispatch state at all.
tests/test_rope.py holds this function to each family's own, bit for bit."""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: heads [B, heads, S, D]; cos, sin: a rotary embedding's [B, S, R]. The first R channels
    of each head turn as R/2 complex pairs (channel i with i + R/2); the rest pass unchanged
    (partial rotary: Qwen3-Next, Qwen3.5; R = D elsewhere)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    turned, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    halves_swapped = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    turned = turned * cos + halves_swapped * sin
    return turned if passed.shape[-1] == 0 else torch.cat((turned, passed), dim=-1)
