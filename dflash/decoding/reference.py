"""Speculative decoding with a DFlash drafter, and plain decoding as its reference.

Each round: the drafter fills one block [anchor, MASK x (B-1)] in a single forward, conditioned
on the target features of every committed position before the anchor; the target verifies the
block in one forward; the longest prefix of drafted tokens equal to the target's own choices at
those positions is accepted, plus the target's choice at the first mismatch (the bonus).
Acceptance length = accepted + 1.

The target's choice is the argmax (temperature 0) or a sample from softmax(logits / T). A
drafted token is kept only when it equals the target's own choice, so every committed token is
the target's choice given a committed prefix: greedy output is identical token for token to
plain greedy decoding, and sampled output has exactly the target's distribution. The drafter
proposes its argmax at every temperature.

Caching: the target keeps a KV cache cropped back to the committed tokens after each
verification; the drafter keeps per-layer keys/values of its context (projections of target
features, which never change once a token is committed) and appends to them. A target whose
cache cannot be cropped (linear-attention layers, e.g. Qwen3-Next) re-runs the whole sequence
each round instead: exact, slower (`TargetSession.cached`). This is the reference path; decoding
runs on dflash.decoding's static caches, which roll such layers back exactly.

The drafter is called through the same mask builder as in training (one valid anchor, full
context before it), so a train/inference mismatch in the mask cannot hide here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash.models.drafter import DFlashDrafter
from dflash.models.target import FrozenTarget
from dflash.step.blocks import layer_masks

# Layer types whose KV cache can be cut back to a prefix after a rejected draft.
_CROPPABLE_LAYERS = {"full_attention"}


@dataclass
class DecodeResult:
    output_ids: list[int]  # generated tokens only
    # Speculative decoding: tokens produced per target verification after the prefill.
    acceptance_lengths: list[int] = field(default_factory=list)


class TokenChooser:
    """The target's choice at each position: argmax, or a seeded sample at `temperature`."""

    def __init__(self, temperature: float, device: torch.device, seed: int = 0):
        self.temperature = temperature
        self.generator = None
        if temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def __call__(self, logits_NV: torch.Tensor) -> list[int]:
        if self.temperature <= 0:
            return logits_NV.argmax(-1).tolist()
        probs = torch.softmax(logits_NV.float() / self.temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1).tolist()


def supports_cache_crop(target: FrozenTarget) -> bool:
    layer_types = getattr(target.config, "layer_types", None) or ["full_attention"]
    return set(layer_types) <= _CROPPABLE_LAYERS


class TargetSession:
    """One sequence through the target: `run(new_ids)` returns logits and features of the new
    positions given everything committed so far; `commit(n)` keeps the first n tokens."""

    def __init__(self, target: FrozenTarget, cached: bool | None = None):
        self.target = target
        self.cached = supports_cache_crop(target) if cached is None else cached
        self.ids: list[int] = []  # tokens the target has seen (committed, then maybe drafted)
        self.cache = None
        if self.cached:
            # A sliding-window target gets full-length layers: transformers' sliding layers keep
            # only the window and cannot be cropped back once it is full (a rejected draft past
            # the window then fails); the model's sliding mask still hides keys outside it.
            windowed = getattr(target.config, "sliding_window", None) is not None
            self.cache = DynamicCache() if windowed else DynamicCache(config=target.config)

    def run(self, new_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [N, V] and features [1, N, F] of the N new positions."""
        start = len(self.ids)
        self.ids += new_ids
        if self.cached:
            ids = torch.tensor([new_ids], device=self.target.device)
            out = self.target(ids, cache=self.cache)
            return out.logits[0], out.features
        out = self.target(torch.tensor([self.ids], device=self.target.device))
        return out.logits[0, start:], out.features[:, start:]

    def commit(self, length: int) -> None:
        surplus = len(self.ids) - length
        if surplus > 0:
            del self.ids[length:]
            if self.cached:
                self.cache.crop(-surplus)  # negative: remove that many (every transformers version)


class DrafterContext:
    """The drafter's cached context keys/values: positions 0..length-1 of the sequence."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = 0

    def extend(self, features_1NF: torch.Tensor) -> None:
        count = features_1NF.shape[1]
        positions = torch.arange(self.length, self.length + count, device=features_1NF.device)
        new = self.drafter.context_kv(features_1NF, positions.unsqueeze(0))
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [
                (torch.cat([k, k_new], dim=2), torch.cat([v, v_new], dim=2))
                for (k, v), (k_new, v_new) in zip(self.kv, new)
            ]
        self.length += count

    @torch.no_grad()
    def draft(self, target: FrozenTarget, anchor_token: int) -> list[int]:
        """The drafter's B-1 argmax guesses for the tokens after the anchor at position `length`."""
        device = target.device
        anchor_pos, block_size = self.length, self.drafter.block_size
        block_ids = torch.full((1, block_size), self.drafter.mask_token_id, device=device)
        block_ids[0, 0] = anchor_token
        positions = torch.arange(anchor_pos, anchor_pos + block_size, device=device).unsqueeze(0)
        mask = layer_masks(
            torch.tensor([[anchor_pos]], device=device),
            torch.ones((1, 1), dtype=torch.bool, device=device),
            ctx_len=anchor_pos,
            block_size=block_size,
            windows=self.drafter.windows,
        )
        hidden = self.drafter.draft(self.kv, target.embed_tokens(block_ids), positions, mask)
        # fp32 drafter (master weights) in front of a bf16 target head on GPU.
        return target.lm_head(hidden.to(target.lm_head.weight.dtype))[0, 1:].argmax(-1).tolist()


def cut_at_stop(tokens: list[int], stop_ids: frozenset[int]) -> tuple[list[int], bool]:
    """`tokens` up to and including the first stop token, and whether one was found."""
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1], True
    return tokens, False


def accepted_prefix(draft: list[int], target_choices: list[int]) -> int:
    """How many drafted tokens are kept: the prefix equal to the target's own choices."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_choices[accepted]:
        accepted += 1
    return accepted


def settle_round(
    draft: list[int], choices: list[int], room: int, stop_ids: frozenset[int]
) -> tuple[list[int], int, bool]:
    """One verification's outcome: the tokens it produces (accepted drafts, then the target's
    own choice at the first mismatch; at most `room`, cut after a stop token), how many drafts
    were accepted, and whether a stop token ended the output."""
    accepted = accepted_prefix(draft, choices)
    produced = (draft[:accepted] + [choices[accepted]])[:room]
    produced, stopped = cut_at_stop(produced, stop_ids)
    return produced, accepted, stopped


@torch.no_grad()
def plain_generate(
    target: FrozenTarget,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    cached: bool | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> DecodeResult:
    """The reference: one target forward per token, until `max_new_tokens` or a stop token."""
    session = TargetSession(target, cached)
    choose = TokenChooser(temperature, target.device, seed)
    logits, _ = session.run(list(prompt_ids))
    output = choose(logits[-1:])
    while len(output) < max_new_tokens and output[-1] not in stop_ids:
        logits, _ = session.run(output[-1:])
        output += choose(logits)
    return DecodeResult(output_ids=output)


@torch.no_grad()
def speculative_generate(
    target: FrozenTarget,
    drafter: DFlashDrafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    cached: bool | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> DecodeResult:
    session = TargetSession(target, cached)
    context = DrafterContext(drafter)
    choose = TokenChooser(temperature, target.device, seed)
    logits, features = session.run(list(prompt_ids))
    context.extend(features)
    output = choose(logits[-1:])  # the first anchor comes from the target
    acceptance: list[int] = []
    while len(output) < max_new_tokens and output[-1] not in stop_ids:
        committed = len(prompt_ids) + len(output) - 1  # the anchor is not committed yet
        draft = drafter_guess(context, target, output[-1])
        logits, features = session.run([output[-1], *draft])
        produced, accepted, stopped = settle_round(
            draft, choose(logits), max_new_tokens - len(output), stop_ids
        )
        output += produced
        acceptance.append(len(produced))
        if stopped:
            break
        # The anchor and the accepted drafts are committed; their features came from this forward.
        session.commit(committed + accepted + 1)
        context.extend(features[:, : accepted + 1])
    return DecodeResult(output_ids=output, acceptance_lengths=acceptance)


def drafter_guess(context: DrafterContext, target: FrozenTarget, anchor_token: int) -> list[int]:
    """One drafter forward (a seam tests replace with an oracle)."""
    return context.draft(target, anchor_token)
