"""Batch-1 plain and speculative decoding on static caches, each forward a CUDA graph on GPU.

A DFlash round is ONE graph: the drafter's block forward, the target's verification of
[anchor, drafts], and the drafter-context write of the features the verification produced, all
on the device; the host then reads the drafts and the target's choices in one transfer, keeps
the accepted prefix and moves the committed length. Nothing is copied back or cropped: the next
round writes over the rejected positions (dflash.decoding.static_target). A hybrid target's
DeltaNet layers then keep the state after the accepted tokens (`commit`, one more small graph).

Exactness is the algorithm's (dflash.decoding.reference): every committed token is the target's own
choice given the committed prefix, so greedy output equals plain greedy output.

A variant's round is the same graph with the variant's own draft (`draft_block`: DSpark's B
drafts left to right with the Markov bias, DFlash2's selector walk) and a verification of the
drafter's `verify_len` tokens; sampled drafts read Gumbel noise the host draws into an input
buffer before the replay (a graph cannot draw it). The draft's per-round extra (DSpark's
survival probabilities, DFlash2's unary argmax) stays on the device until the decode ends, when
the drafter turns each round's into its figures (`add_round_figures`).
"""

from __future__ import annotations

import copy
import logging

import torch

from dflash.decoding.graphs import GraphedFunction, graphs_enabled
from dflash.decoding.reference import (
    DRAFT_NOISE_SEED_OFFSET,
    DecodeResult,
    TokenChooser,
    gumbel_noise,
    samples_drafts,
    settle_round,
)
from dflash.decoding.settings import DecodeSettings
from dflash.decoding.static_drafter import StaticCacheDrafter
from dflash.decoding.static_target import StaticCacheTarget, static_decoding_refusal
from dflash.drafters.backbone import DFlashDrafter
from dflash.target.model import FrozenTarget

log = logging.getLogger(__name__)


class StaticDecoder:
    """Plain and DFlash decoding of one sequence at a time, up to `max_len` tokens in all
    (prompt + generated). The drafter runs as a copy in the target's dtype, as a serving engine
    runs it. `graphs`: null = CUDA graphs on CUDA; `compile`: each target layer's step and the
    drafter's draft and context write fused by torch.compile before the capture (regional
    compilation: dflash.decoding.static_target)."""

    def __init__(
        self,
        target: FrozenTarget,
        drafter: DFlashDrafter | None = None,
        *,
        max_len: int,
        graphs: bool | None = None,
        compile: bool = False,
        kv_bucket: int = 256,
    ):
        self.target = target
        self.block_size = drafter.block_size if drafter is not None else 1
        # Tokens a round verifies ([anchor, drafts]).
        self.verify_len = drafter.verify_len if drafter is not None else 1
        capacity = max_len + self.verify_len  # a round verifies past the output
        backend = "inductor" if compile else None
        self.target_cache = StaticCacheTarget(
            target,
            slots=1,
            max_len=capacity,
            kv_bucket=kv_bucket,
            features=drafter is not None,
            max_step=self.verify_len,
            compile_backend=backend,
        )
        self.drafter_cache = None
        if drafter is not None:
            dtype = target.lm_head.weight.dtype
            draft_copy = copy.deepcopy(drafter).to(device=target.device, dtype=dtype).eval()
            self.drafter_cache = StaticCacheDrafter(
                draft_copy, target, max_len=self.target_cache.max_len, compile_backend=backend
            )
        enabled = graphs_enabled(graphs, target.device)
        pool = torch.cuda.graph_pool_handle() if enabled else None
        # This decoder's graphs are captured on a stream of its own, so its cuBLAS scratch is
        # its own too: decoders side by side replay at once (dflash.decoding.graphs).
        self.stream = torch.cuda.Stream(device=target.device) if enabled else None
        graphed = {"enabled": enabled, "pool": pool, "stream": self.stream}
        self._plain_step = GraphedFunction(self._plain_fn, **graphed)
        self._round = GraphedFunction(self._round_fn, **graphed)
        self._commit = GraphedFunction(self.target_cache.commit, **graphed)
        device = target.device
        self._ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        self._pos = torch.zeros((1, 1), dtype=torch.long, device=device)
        self._taken = torch.zeros(1, dtype=torch.long, device=device)
        self._noise = None
        if drafter is not None and drafter.samples_drafts:  # one Gumbel row per block position
            vocab = target.lm_head.weight.shape[0]
            self._noise = torch.zeros((self.block_size, vocab), dtype=torch.float32, device=device)

    @classmethod
    def for_target(
        cls,
        target: FrozenTarget,
        drafter: DFlashDrafter | None,
        *,
        max_len: int,
        graphs: bool | None,
        compile: bool = False,
    ) -> StaticDecoder | None:
        """A decoder, or None (logged) when the target needs the dynamic-cache path."""
        refusal = static_decoding_refusal(target)
        if refusal is not None:
            log.info("decoding: dynamic cache (exact, slower): %s", refusal)
            return None
        return cls(target, drafter, max_len=max_len, graphs=graphs, compile=compile)

    @torch.no_grad()
    def load_drafter_weights(self, drafter: DFlashDrafter) -> None:
        """The decoder's drafter copy takes `drafter`'s weights in place (cast to its dtype), so
        the graphs captured on it replay with them: a training run's periodic evaluations
        reuse one decoder instead of capturing (and compiling) a new one each time."""
        if self.drafter_cache is None:
            raise ValueError("StaticDecoder built without a drafter has no drafter weights to load")
        self.drafter_cache.drafter.load_state_dict(drafter.state_dict())

    @property
    def graphs_on(self) -> bool:
        return self._round.enabled

    @property
    def captures(self) -> int:
        return self._plain_step.captures + self._round.captures + self._commit.captures

    @torch.no_grad()
    def capture_every_shape(self, sampled_temperatures: tuple[float, ...] = ()) -> int:
        """Capture the plain step and the round at every attended-length bucket now, so decoding
        never captures (a serving engine captures its graphs at start-up, too): a capture runs the
        step eagerly a few times, and inside a timed decode it would be charged to the prompt
        that first reached the bucket. Run before any prompt: the dummy tokens it writes at
        positions 0..block-1 are overwritten by the next prefill. `sampled_temperatures`: a
        drafter's sampled rounds at these temperatures too, where it samples its drafts (one graph each). Returns the
        number of graphs captured (0 with graphs off)."""
        if not self.graphs_on:
            return 0
        self._set(0, 0)
        for kv_len in range(
            self.target_cache.kv_bucket, self.target_cache.max_len + 1, self.target_cache.kv_bucket
        ):
            self._plain_step(self._ids, self._pos, kv_len=kv_len)
            if self.drafter_cache is not None:
                self._round(self._ids, self._pos, kv_len=kv_len)
            for temperature in sampled_temperatures if self._noise is not None else ():
                self._round(self._ids, self._pos, self._noise, kv_len=kv_len, temperature=temperature)
        if self.target_cache.recurrent:
            self.keep(0)  # the commit's graph (one shape); 0 keeps every state as it is
        return self.captures

    # -- captured functions: device tensors in, device tensors out -------------------------------
    def _plain_fn(self, ids_11: torch.Tensor, pos_11: torch.Tensor, *, kv_len: int) -> torch.Tensor:
        logits, _ = self.target_cache.step(ids_11, pos_11, kv_len=kv_len)
        return logits[0]

    def _round_fn(
        self,
        anchor_11: torch.Tensor,
        pos_11: torch.Tensor,
        noise_BV: torch.Tensor | None = None,
        *,
        kv_len: int,
        temperature: float = 0.0,
    ):
        """One round: the drafts, the target's logits over [anchor, drafts], and the draft's
        per-round extra (None where the variant has none)."""
        drafts, extra = self.drafter_cache.round_draft(
            anchor_11[0], pos_11[0], noise_BV, kv_len=kv_len, temperature=temperature
        )
        ids = torch.cat([anchor_11[0], drafts]).view(1, -1)
        positions = pos_11 + self.drafter_cache.verify_offsets
        logits, features = self.target_cache.step(ids, positions, kv_len=kv_len)
        self.drafter_cache.write(features, positions)
        return drafts, logits[0], extra

    # -- host side -------------------------------------------------------------------------------
    def _set(self, token: int, position: int) -> None:
        self._ids.fill_(token)
        self._pos.fill_(position)

    def keep(self, tokens: int) -> None:
        """After a plain step or a round: the target's DeltaNet states advance by the first
        `tokens` tokens it ran (a round keeps the anchor and the accepted drafts). Nothing to
        do for a full-attention target, whose rollback is the committed length alone."""
        if self.target_cache.recurrent:
            self._taken.fill_(tokens)
            self._commit(self._taken)

    def _prefill(self, prompt: list[int]):
        ids = torch.tensor([prompt], device=self.target.device)
        last = torch.tensor([len(prompt) - 1], device=self.target.device)
        rows = torch.zeros(1, dtype=torch.long, device=self.target.device)
        return self.target_cache.prefill(ids, rows, last)

    @torch.no_grad()
    def prefill_only(self, prompt: list[int]) -> None:
        """The prefill both decoding paths start with, alone (dflash-eval times it apart)."""
        self._check_room(prompt, 0)
        self._prefill(prompt)

    def _check_room(self, prompt: list[int], max_new_tokens: int) -> None:
        need = len(prompt) + max_new_tokens + self.verify_len
        if need > self.target_cache.max_len:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens + {max_new_tokens} new does not fit the decoder's "
                f"static cache ({self.target_cache.max_len} positions): build it with a larger max_len"
            )

    @torch.no_grad()
    def plain(self, prompt: list[int], settings: DecodeSettings) -> DecodeResult:
        """One target forward per token (the reference DFlash is timed against)."""
        self._check_room(prompt, settings.max_new_tokens)
        choose = TokenChooser(settings.temperature, self.target.device, settings.seed)
        logits, _ = self._prefill(prompt)
        output = choose(logits)
        while len(output) < settings.max_new_tokens and output[-1] not in settings.stop_ids:
            position = len(prompt) + len(output) - 1
            self._set(output[-1], position)
            kv_len = self.target_cache.kv_len_for(position + 1)
            output += choose(self._plain_step(self._ids, self._pos, kv_len=kv_len))
            self.keep(1)
        return DecodeResult(output_ids=output)

    @torch.no_grad()
    def speculative(
        self, prompt: list[int], settings: DecodeSettings, *, sampled_drafts: bool = False
    ) -> DecodeResult:
        """`sampled_drafts`: a drafter that can sample its drafts (DSpark, DFlash2) samples them at
        `settings.temperature` (> 0) instead of taking their argmax
        (dflash.decoding.reference.speculative_generate)."""
        if self.drafter_cache is None:
            raise ValueError("StaticDecoder built without a drafter cannot decode speculatively")
        self._check_room(prompt, settings.max_new_tokens)
        choose = TokenChooser(settings.temperature, self.target.device, settings.seed)
        noise = None
        if samples_drafts(self.drafter_cache.drafter, settings.temperature, sampled_drafts):
            noise = torch.Generator(device=self.target.device)
            noise.manual_seed(settings.seed + DRAFT_NOISE_SEED_OFFSET)
        logits, features = self._prefill(prompt)
        positions = torch.arange(len(prompt), device=self.target.device).unsqueeze(0)
        self.drafter_cache.write(features, positions)
        output = choose(logits)  # the first anchor comes from the target
        committed = len(prompt)  # positions with valid keys in both caches; the anchor goes next
        result = DecodeResult(output_ids=output)
        # Per round with an extra: the extra on the device (read once, at the end) and the
        # round's outcome, for the drafter's figures.
        extras: list[torch.Tensor] = []
        outcomes: list[dict] = []
        while len(output) < settings.max_new_tokens and output[-1] not in settings.stop_ids:
            self._set(output[-1], committed)
            kv_len = self.target_cache.kv_len_for(committed + self.verify_len)
            if noise is None:
                drafts, logits, extra = self._round(self._ids, self._pos, kv_len=kv_len)
            else:
                self._noise.copy_(gumbel_noise(noise, tuple(self._noise.shape), self.target.device))
                drafts, logits, extra = self._round(
                    self._ids, self._pos, self._noise, kv_len=kv_len, temperature=settings.temperature
                )
            draft, choices = self._read(drafts, logits, choose)
            room = settings.max_new_tokens - len(output)
            produced, accepted, stopped = settle_round(draft, choices, room, settings.stop_ids)
            output += produced
            result.acceptance_lengths.append(len(produced))
            result.accepted_drafts.append(accepted)
            if extra is not None:
                extras.append(extra.clone())  # the graph's output buffer is reused
                outcomes.append({"draft": draft, "choices": choices, "accepted": accepted})
            if stopped:
                break
            committed += accepted + 1
            self.keep(accepted + 1)
        if extras:
            for extra, outcome in zip(torch.stack(extras).tolist(), outcomes):
                self.drafter_cache.drafter.add_round_figures(result, extra, **outcome)
        return result

    @staticmethod
    def _read(
        drafts: torch.Tensor, logits: torch.Tensor, choose: TokenChooser
    ) -> tuple[list[int], list[int]]:
        """Drafts and the target's choices on the host; greedy reads both in one transfer."""
        count = len(drafts)
        if choose.temperature <= 0:
            both = torch.cat([drafts, logits.argmax(-1)]).tolist()
            return both[:count], both[count:]
        return drafts.tolist(), choose(logits)
