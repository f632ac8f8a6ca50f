"""Continuous batching on the static-cache target: `slots` sequences decode together, and a
slot whose sequence finished takes the next queued prompt, so no batch waits for its longest
reply (what turn-by-turn `generate` batches did).

Each `step()` first prefills queued prompts into free slots (eager, right-padded, grouped up to
`prefill_tokens` tokens per forward) when enough slots are free to make a prefill worth its
launch cost (`refill_at`, or none is decoding), then runs one decode step of every slot as one
CUDA graph (per attended-length bucket) and samples the next tokens. Free slots ride along in
the step (their keys and DeltaNet states land in their own rows, which the next prefill
overwrites): a fixed batch shape is what lets one graph serve the whole run. A hybrid target's
DeltaNet states then keep every slot's one new token (`commit`, a second graph).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dflash.decoding.graphs import GraphedFunction, graphs_enabled
from dflash.decoding.sampling import Sampler
from dflash.decoding.static_target import StaticCacheTarget
from dflash.target.model import FrozenTarget


@dataclass
class Finished:
    tag: Any
    tokens: list[int]  # generated tokens, the stop token excluded
    finish_reason: str  # "stop" or "length"
    stop_token: int | None = None  # the stop token that ended it ("stop")


@dataclass
class _Sequence:
    tag: Any
    prompt_len: int
    tokens: list[int] = field(default_factory=list)


class ContinuousBatcher:
    def __init__(
        self,
        target: FrozenTarget,
        *,
        slots: int,
        max_len: int,
        max_new_tokens: int,
        stop_ids: frozenset[int],
        sampler: Sampler,
        graphs: bool | None = None,
        compile: bool = False,
        kv_bucket: int = 256,
        prefill_tokens: int = 16384,
    ):
        self.cache = StaticCacheTarget(
            target,
            slots=slots,
            max_len=max_len,
            kv_bucket=kv_bucket,
            features=False,
            compile_backend="inductor" if compile else None,
        )
        self.device = target.device
        self.slots, self.max_new_tokens, self.stop_ids = slots, max_new_tokens, stop_ids
        self.sampler, self.prefill_tokens = sampler, prefill_tokens
        self.refill_at = max(1, slots // 8)
        enabled = graphs_enabled(graphs, self.device)
        self.step_fn = GraphedFunction(self._step, enabled=enabled)
        self.commit_fn = GraphedFunction(self.cache.commit, enabled=enabled)
        self.one_each = torch.ones(slots, dtype=torch.long, device=self.device)
        self.queue: deque[tuple[Any, list[int]]] = deque()
        self.running: list[_Sequence | None] = [None] * slots
        self.next_ids = torch.zeros((slots, 1), dtype=torch.long, device=self.device)
        self.generated_tokens = 0

    def reset(self) -> None:
        """Drop every queued and running sequence (after an interrupted run: their tags are
        stale). The cache needs no clearing: a slot's next prefill overwrites it."""
        self.queue.clear()
        self.running = [None] * self.slots

    def configure(self, *, max_new_tokens: int, stop_ids: frozenset[int]) -> None:
        """Another reply length and stop set for the sequences submitted next (an evaluation's
        prompt sets differ in both); the cache and graphs stay. Only between batches."""
        if self.busy:
            raise RuntimeError("ContinuousBatcher.configure while sequences are queued or decoding")
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids

    def fits(self, prompt_len: int) -> bool:
        return prompt_len + self.max_new_tokens <= self.cache.max_len

    def submit(self, tag: Any, prompt: list[int]) -> None:
        if not self.fits(len(prompt)):
            raise ValueError(
                f"a {len(prompt)}-token prompt + {self.max_new_tokens} new exceeds {self.cache.max_len}"
            )
        self.queue.append((tag, prompt))

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(s is not None for s in self.running)

    @property
    def decoding(self) -> int:
        return sum(s is not None for s in self.running)

    def step(self) -> list[Finished]:
        finished: list[Finished] = []
        free = [row for row, s in enumerate(self.running) if s is None]
        if self.queue and free and (len(free) >= self.refill_at or not self.decoding):
            finished += self._refill(free)
        if self.decoding:
            finished += self._decode()
        return finished

    def _step(self, ids_S1: torch.Tensor, positions_S1: torch.Tensor, *, kv_len: int) -> torch.Tensor:
        logits, _ = self.cache.step(ids_S1, positions_S1, kv_len=kv_len)
        return logits[:, 0]

    def _advance(self, row: int, token: int, finished: list[Finished]) -> None:
        sequence = self.running[row]
        self.generated_tokens += 1
        if token in self.stop_ids:
            finished.append(Finished(sequence.tag, sequence.tokens, "stop", stop_token=token))
        else:
            sequence.tokens.append(token)
            if len(sequence.tokens) < self.max_new_tokens:
                return
            finished.append(Finished(sequence.tag, sequence.tokens, "length"))
        self.running[row] = None

    @torch.no_grad()
    def _refill(self, free: list[int]) -> list[Finished]:
        taken = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        rows = free[: len(taken)]
        finished: list[Finished] = []
        start = 0
        while start < len(taken):
            # A group: as many prompts as fit `prefill_tokens` once padded to the longest.
            end, longest = start, 0
            while end < len(taken):
                longest_with = max(longest, len(taken[end][1]))
                if end > start and longest_with * (end - start + 1) > self.prefill_tokens:
                    break
                longest, end = longest_with, end + 1
            group, group_rows = taken[start:end], rows[start:end]
            ids = torch.zeros((len(group), longest), dtype=torch.long)
            for index, (_, prompt) in enumerate(group):
                ids[index, : len(prompt)] = torch.as_tensor(prompt)
            last = torch.tensor([len(prompt) - 1 for _, prompt in group])
            row_ids = torch.tensor(group_rows, device=self.device)
            logits, _ = self.cache.prefill(ids.to(self.device), row_ids, last.to(self.device))
            first = self.sampler(logits)
            self.next_ids[row_ids, 0] = first
            for row, (tag, prompt), token in zip(group_rows, group, first.tolist()):
                self.running[row] = _Sequence(tag, len(prompt))
                self._advance(row, token, finished)
            start = end
        return finished

    @torch.no_grad()
    def _decode(self) -> list[Finished]:
        positions = np.zeros((self.slots, 1), dtype=np.int64)
        for row, sequence in enumerate(self.running):
            if sequence is not None:  # the last sampled token, after the prompt and the earlier ones
                positions[row, 0] = sequence.prompt_len + len(sequence.tokens) - 1
        kv_len = self.cache.kv_len_for(int(positions.max()) + 1)
        logits = self.step_fn(self.next_ids, torch.from_numpy(positions).to(self.device), kv_len=kv_len)
        if self.cache.recurrent:
            self.commit_fn(self.one_each)
        tokens = self.sampler(logits)
        self.next_ids.copy_(tokens.unsqueeze(1))
        finished: list[Finished] = []
        for row, token in enumerate(tokens.tolist()):
            if self.running[row] is not None:
                self._advance(row, token, finished)
        return finished
