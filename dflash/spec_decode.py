"""Greedy speculative decoding with a DFlash drafter, and the plain greedy reference.

Each round: the drafter fills one block [anchor, MASK x (B-1)] in a single forward, conditioned
on the target features of every position before the anchor; the target verifies the block in
one forward; the longest prefix of drafted tokens that matches the target's own greedy choices
is accepted, plus the target's next token (the bonus). Acceptance length = accepted + 1.

The drafter is called through the same mask builder as in training (one valid anchor, full
context before it), so a train/inference mismatch in the mask cannot hide here.

This reference loop re-runs the target over the whole sequence each round (no KV cache):
simple and exact, meant for tau and losslessness checks, not for timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.blocks import block_attention_mask
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import FrozenTarget


@dataclass
class SpecDecodeResult:
    output_ids: list[int]  # generated tokens only
    acceptance_lengths: list[int]  # tokens produced per target verification


@torch.no_grad()
def greedy_generate(target: FrozenTarget, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = target(torch.tensor([ids], device=target.device)).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


@torch.no_grad()
def draft_block(
    drafter: DFlashDrafter, target: FrozenTarget, features_1SF: torch.Tensor, anchor_token: int
) -> list[int]:
    """The drafter's B-1 greedy guesses for the tokens after the anchor at position S."""
    device = target.device
    anchor_pos = features_1SF.shape[1]
    block_size = drafter.block_size
    block_ids = torch.full((1, block_size), drafter.mask_token_id, device=device)
    block_ids[0, 0] = anchor_token
    positions = torch.arange(anchor_pos, anchor_pos + block_size, device=device).unsqueeze(0)
    mask = block_attention_mask(
        torch.tensor([[anchor_pos]], device=device),
        torch.ones((1, 1), dtype=torch.bool, device=device),
        ctx_len=anchor_pos,
        block_size=block_size,
    )
    hidden = drafter(features_1SF, target.embed_tokens(block_ids), positions, mask)
    # fp32 drafter (master weights) in front of a bf16 target head on GPU.
    return target.lm_head(hidden.to(target.lm_head.weight.dtype))[0, 1:].argmax(-1).tolist()


@torch.no_grad()
def speculative_generate(
    target: FrozenTarget, drafter: DFlashDrafter, prompt_ids: list[int], max_new_tokens: int
) -> SpecDecodeResult:
    ids = list(prompt_ids)
    out = target(torch.tensor([ids], device=target.device))
    ids.append(int(out.logits[0, -1].argmax()))  # the first anchor comes from the target
    features = out.features
    acceptance: list[int] = []
    limit = len(prompt_ids) + max_new_tokens
    while len(ids) < limit:
        anchor = len(ids) - 1
        draft = draft_block(drafter, target, features[:, :anchor], ids[anchor])
        out = target(torch.tensor([ids + draft], device=target.device))
        verified = out.logits[0, anchor : anchor + len(draft) + 1].argmax(-1).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == verified[accepted]:
            accepted += 1
        produced = (draft[:accepted] + [verified[accepted]])[: limit - len(ids)]
        ids += produced
        acceptance.append(len(produced))
        # Features of positions up to the last accepted token were computed on the right prefix.
        features = out.features[:, : anchor + accepted + 1]
    return SpecDecodeResult(output_ids=ids[len(prompt_ids) :], acceptance_lengths=acceptance)
