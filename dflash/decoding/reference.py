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
proposes its argmax at every temperature. With `verify=rejection` a sampled round settles by
speculative sampling instead (dflash.decoding.verify: the serving engines' rule), which keeps the
target's distribution too.

Caching: the target keeps a KV cache cropped back to the committed tokens after each
verification; the drafter keeps per-layer keys/values of its context (projections of target
features, which never change once a token is committed) and appends to them. A target whose
cache cannot be cropped (linear-attention layers, e.g. Qwen3-Next) re-runs the whole sequence
each round instead: exact, slower (`TargetSession.cached`). This is the reference path; decoding
runs on dflash.decoding's static caches, which roll such layers back exactly.

The drafter is called through the same mask builder as in training (one valid anchor, full
context before it), so a train/inference mismatch in the mask cannot hide here.

A DSpark drafter (dflash.drafters.dspark) drafts B tokens per block instead of B-1 (every block
slot predicts, the anchor's too: slot k proposes the token at anchor + k + 1) and drafts them
left to right: slot k's logits are the base logits (the target's LM head on the slot's hidden
state) plus the Markov head's bias from the token actually drafted before it (the anchor for
slot 0). Each token is the argmax of those logits, or with `sampled_drafts` at a temperature > 0
a Gumbel-max sample from them (noise drawn per round from a generator of its own, so the
target's choices draw the same stream as without it). Verification is the same: a round
verifies [anchor, B drafts] and produces up to B + 1 tokens. With a confidence head, each draft
also gets the head's probability that it is accepted given that every draft before it was
(a round figure, `DecodeResult.round_figures`), to set beside the acceptance measured
(`accepted_drafts`).

A DFlash2 drafter (dflash.drafters.dflash2) drafts B-1 tokens from one block forward as DFlash does,
then its candidate selector walks the draft positions left to right: each position's top-K
candidates under the unary logits (the target's LM head on the position's hidden state), scored
given the token chosen before it (the anchor first), the argmax of the scores or, with
`sampled_drafts` at a temperature > 0, a Gumbel-max sample over the K candidates (the same noise
rows DSpark reads, one per position, taken at the candidates' ids). Verification is DFlash's.
Each round also records where the selector's token differs from the unary argmax (what plain
DFlash would have drafted) and how those drafts fared (round figures, `DecodeResult.round_figures`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from dflash.decoding.settings import DecodeSettings
from dflash.decoding.verify import VerifyRule, rejection_round
from dflash.drafters.backbone import DFlashDrafter
from dflash.step.blocks import layer_masks
from dflash.target.model import FrozenTarget

# Layer types whose KV cache can be cut back to a prefix after a rejected draft.
_CROPPABLE_LAYERS = {"full_attention"}


# The draft noise's generator is seeded apart from the target's (seed + this), so sampling
# drafts leaves the target's own stream of choices as it is.
DRAFT_NOISE_SEED_OFFSET = 1_000_003


@dataclass
class DecodeResult:
    output_ids: list[int]  # generated tokens only
    # Speculative decoding: tokens produced per target verification after the prefill.
    acceptance_lengths: list[int] = field(default_factory=list)
    # Per round: drafts accepted (before the bonus; not cut by max_new_tokens or a stop token).
    accepted_drafts: list[int] = field(default_factory=list)
    # Per round, the drafter's own figures by name (`DFlashDrafter.add_round_figures`: a DSpark
    # confidence head's survival probabilities, a DFlash2 selector's changes): one entry per
    # round that recorded the figure; tallied by the drafter's `round_tally`.
    round_figures: dict[str, list] = field(default_factory=dict)

    def record_round(self, figures: Mapping[str, Any]) -> None:
        """One round's figures, each appended to the list of its name."""
        for name, value in figures.items():
            self.round_figures.setdefault(name, []).append(value)


def gumbel_noise(generator: torch.Generator, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """-log(-log(U)), U uniform: argmax(logits / T + noise) is a sample from softmax(logits / T)
    (the Gumbel-max trick, as vLLM's DSpark drafter samples: `gumbel_sample` in
    vllm/v1/worker/gpu/spec_decode/dspark/speculator.py). Drawn outside the drafting, so a CUDA
    graph can replay it as an input."""
    uniform = torch.rand(shape, generator=generator, device=device).clamp_(min=1e-20)
    return -torch.log(-torch.log(uniform))


class DraftChooser:
    """Each draft position's token from its logits [N, V]: the argmax, or with `noise_KV` (one
    row per draft position, `gumbel_noise`) a sample at `temperature`. Called once per position,
    left to right (dflash.drafters.dspark.DSparkDrafter.sample_block); `among` is the same choice
    over a DFlash2 selector's K candidates."""

    def __init__(
        self, temperature: float = 0.0, noise_KV: torch.Tensor | None = None, *, record: bool = False
    ):
        if noise_KV is not None and temperature <= 0:
            raise ValueError("sampled drafts need a temperature > 0")
        self.temperature, self.noise, self.position = temperature, noise_KV, 0
        # record: keep each sampled position's draft distribution [N, V] (what rejection
        # sampling verifies against, dflash.decoding.verify), in position order.
        self.record = record
        self.distributions: dict[int, torch.Tensor] = {}

    def __call__(self, logits_NV: torch.Tensor) -> torch.Tensor:
        if self.noise is None:
            return logits_NV.argmax(-1)
        noise = self.noise[self.position]
        scaled = logits_NV.float() / self.temperature
        if self.record:
            self.distributions[self.position] = torch.softmax(scaled, dim=-1)
        self.position += 1
        return (scaled + noise).argmax(-1)

    def among(self, scores_NK: torch.Tensor, candidates_NK: torch.Tensor, position: int) -> torch.Tensor:
        """The index [N] of draft `position`'s candidate: the best score, or a sample from
        softmax(scores / T) over the candidates. Gumbel noise read at the candidates' distinct
        ids is independent per candidate, so the argmax over them is an exact sample."""
        if self.noise is None:
            return scores_NK.argmax(-1)
        noise = self.noise[position][candidates_NK]
        scaled = scores_NK.float() / self.temperature
        if self.record:
            vocabulary = self.noise.shape[-1]
            probs = torch.zeros(scores_NK.shape[0], vocabulary, device=scores_NK.device)
            self.distributions[position] = probs.scatter_(1, candidates_NK, torch.softmax(scaled, dim=-1))
        return (scaled + noise).argmax(-1)

    def drafted_distributions(self) -> torch.Tensor:
        """The recorded draft distributions of the first sequence, one row per position [P, V]."""
        return torch.stack([self.distributions[k][0] for k in sorted(self.distributions)])


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
        # How the next draft picks its tokens (None: argmax), set per round.
        self.choose: DraftChooser | None = None
        # The last draft's per-round extra (`draft_block`'s second output, on the host; None
        # when the variant returns none): DSpark's survival probabilities, DFlash2's unary argmax.
        self.extra: list | None = None
        # The projected context row before the next anchor [1, H] (a drafter that
        # `reads_anchor_row`): the last committed position's, as `extend` receives committed rows only.
        self.anchor_row: torch.Tensor | None = None

    def extend(self, features_1NF: torch.Tensor) -> None:
        count = features_1NF.shape[1]
        positions = torch.arange(self.length, self.length + count, device=features_1NF.device)
        new = self.drafter.context_kv(features_1NF, positions.unsqueeze(0))
        if self.drafter.reads_anchor_row:
            self.anchor_row = self.drafter.context(features_1NF[:, -1])
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
        """The drafter's guesses for the tokens after the anchor at position `length`
        (`draft_block`: a DFlash drafter's B-1 argmaxes, a variant's own walk picked by
        `choose`)."""
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
        inputs = {}
        if self.drafter.reads_anchor_row:
            inputs = {"embed_tokens": target.embed_tokens, "anchor_row_1H": self.anchor_row}
        tokens, extra = self.drafter.draft_block(
            target.lm_head, hidden, block_ids[0, :1], self.choose or DraftChooser(), **inputs
        )
        self.extra = None if extra is None else extra.tolist()
        return tokens.tolist()


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
    settings: DecodeSettings,
    *,
    cached: bool | None = None,
) -> DecodeResult:
    """The reference: one target forward per token, until `settings.max_new_tokens` or a stop token."""
    session = TargetSession(target, cached)
    choose = TokenChooser(settings.temperature, target.device, settings.seed)
    logits, _ = session.run(list(prompt_ids))
    output = choose(logits[-1:])
    while len(output) < settings.max_new_tokens and output[-1] not in settings.stop_ids:
        logits, _ = session.run(output[-1:])
        output += choose(logits)
    return DecodeResult(output_ids=output)


def samples_drafts(drafter: DFlashDrafter, temperature: float, sampled_drafts: bool) -> bool:
    """Whether the drafts of a round are sampled: a drafter that can sample them (DSpark, DFlash2)
    asked to, at a temperature > 0. A DFlash drafter proposes its argmax at every temperature."""
    return sampled_drafts and temperature > 0 and drafter.samples_drafts


@torch.no_grad()
def speculative_generate(
    target: FrozenTarget,
    drafter: DFlashDrafter,
    prompt_ids: list[int],
    settings: DecodeSettings,
    *,
    cached: bool | None = None,
    sampled_drafts: bool = False,
    verify: VerifyRule = VerifyRule.match,
) -> DecodeResult:
    """`verify`: how drafts are kept at a temperature > 0 (dflash.decoding.verify)."""
    session = TargetSession(target, cached)
    context = DrafterContext(drafter)
    choose = TokenChooser(settings.temperature, target.device, settings.seed)
    rejection = VerifyRule(verify) is VerifyRule.rejection and settings.temperature > 0
    noise = None
    if samples_drafts(drafter, settings.temperature, sampled_drafts):
        noise = torch.Generator(device=target.device)
        noise.manual_seed(settings.seed + DRAFT_NOISE_SEED_OFFSET)
    logits, features = session.run(list(prompt_ids))
    context.extend(features)
    output = choose(logits[-1:])  # the first anchor comes from the target
    result = DecodeResult(output_ids=output)
    while len(output) < settings.max_new_tokens and output[-1] not in settings.stop_ids:
        committed = len(prompt_ids) + len(output) - 1  # the anchor is not committed yet
        if noise is not None:
            shape = (drafter.block_size, target.lm_head.weight.shape[0])
            noise_KV = gumbel_noise(noise, shape, target.device)
            context.choose = DraftChooser(settings.temperature, noise_KV, record=rejection)
        draft = drafter_guess(context, target, output[-1])
        logits, features = session.run([output[-1], *draft])
        if rejection:
            kept, token = rejection_round(
                draft,
                draft_probs_PV=None if noise is None else context.choose.drafted_distributions(),
                target_logits_NV=logits,
                temperature=settings.temperature,
                generator=choose.generator,
            )
            choices = draft[:kept] + [token]  # the token is never the rejected draft (residual)
        else:
            choices = choose(logits)
        produced, accepted, stopped = settle_round(
            draft, choices, settings.max_new_tokens - len(output), settings.stop_ids
        )
        output += produced
        result.acceptance_lengths.append(len(produced))
        result.accepted_drafts.append(accepted)
        drafter.add_round_figures(result, context.extra, draft=draft, choices=choices, accepted=accepted)
        if stopped:
            break
        # The anchor and the accepted drafts are committed; their features came from this forward.
        session.commit(committed + accepted + 1)
        context.extend(features[:, : accepted + 1])
    return result


def drafter_guess(context: DrafterContext, target: FrozenTarget, anchor_token: int) -> list[int]:
    """One drafter forward (a seam tests replace with an oracle)."""
    return context.draft(target, anchor_token)
