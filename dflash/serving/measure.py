"""The same prompts decoded greedily by dflash's own decoder and by a serving engine, one prompt
at a time, and the figures side by side per benchmark: tau, acceptance per draft position,
tokens/s, and per prompt whether the target outputs and the accepted drafts agree
(dflash.serving.agreement counts dflash's rounds by the engine's cap rules first).

Tolerance: where the two target outputs are identical, the drafter saw the same context on both
sides, so its drafts differ only where the engine's float32 kernels and torch's break a
near-tie of the drafter's logits the other way. `DRAFT_TOLERANCE` bounds that: the share of
such prompts whose accepted drafts may differ, and a benchmark's served tau may differ from
dflash's (counted by the engine's rules) by at most `TAU_TOLERANCE` relative. A larger gap is a
fault on one side, and the verdict says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from dflash.decoding.reference import DecodeResult, speculative_generate
from dflash.decoding.settings import DecodeSettings
from dflash.eval.results import acceptance_figures
from dflash.serving.agreement import PromptAgreement, RoundCount, agreement, engine_count
from dflash.serving.server import ServedDecode

# Share of same-output prompts whose accepted drafts may differ (ties broken apart by the two
# sides' float32 arithmetic). On the tiny chain (float32, three variants, 21 same-output prompts)
# none differed: the room is for real models, whose logits hold closer ties.
DRAFT_TOLERANCE = 0.1
TAU_TOLERANCE = 0.02


@dataclass
class ServedBenchmark:
    benchmark: str
    prompts: list[PromptAgreement] = field(default_factory=list)
    own_tau: float = 0.0  # dflash eval's tau: tokens per verification, its own rounds
    own_tokens_per_s: float = 0.0
    served_tokens_per_s: float = 0.0

    def _pooled(self, side: str) -> RoundCount:
        counts = [getattr(p, side) for p in self.prompts]
        width = max((len(c.accepted_per_position) for c in counts), default=0)
        return RoundCount(
            accepted=sum(c.accepted for c in counts),
            verifications=sum(c.verifications for c in counts),
            accepted_per_position=tuple(
                sum(c.accepted_per_position[i] for c in counts if i < len(c.accepted_per_position))
                for i in range(width)
            ),
        )

    @property
    def own(self) -> RoundCount:
        return self._pooled("own")

    @property
    def served(self) -> RoundCount:
        return self._pooled("served")

    @property
    def same_output(self) -> list[PromptAgreement]:
        return [p for p in self.prompts if p.same_output]

    @property
    def within_tolerance(self) -> bool:
        same = self.same_output
        differing = sum(not p.drafts_agree for p in same)
        tau_gap = abs(self.served.tau - self.own.tau) / self.own.tau
        return differing <= DRAFT_TOLERANCE * len(same) and tau_gap <= TAU_TOLERANCE

    def position_shares(self, side: str) -> list[float]:
        count = getattr(self, side)
        return [round(n / max(1, count.verifications), 4) for n in count.accepted_per_position]

    def to_json(self) -> dict:
        same = self.same_output
        return {
            "benchmark": self.benchmark,
            "num_prompts": len(self.prompts),
            "own_tau": round(self.own_tau, 4),
            "own_tau_engine_rules": round(self.own.tau, 4),
            "served_tau": round(self.served.tau, 4),
            "own_accepted_by_position": self.position_shares("own"),
            "served_accepted_by_position": self.position_shares("served"),
            "own_tokens_per_s": round(self.own_tokens_per_s, 2),
            "served_tokens_per_s": round(self.served_tokens_per_s, 2),
            "same_output": len(same),
            "same_output_drafts_agree": sum(p.drafts_agree for p in same),
            "accepted_differences": [p.accepted_difference for p in self.prompts],
            "within_tolerance": self.within_tolerance,
            # Per prompt, in the benchmark's order: where a difference lies, and on which side.
            "per_prompt": [
                {
                    "same_output": p.same_output,
                    "drafts_agree": p.drafts_agree,
                    "own": {"accepted": p.own.accepted, "verifications": p.own.verifications},
                    "served": {"accepted": p.served.accepted, "verifications": p.served.verifications},
                }
                for p in self.prompts
            ],
        }


ServeOne = Callable[[list[int], int], ServedDecode]


def measure_benchmark(
    name: str,
    prompts: list[list[int]],
    *,
    target,
    drafter,
    serve: ServeOne,
    max_new_tokens: int,
    drafts_per_round: int,
    stop_ids: frozenset[int],
    overlap: bool = False,
) -> ServedBenchmark:
    """Each prompt decoded by dflash (timed on the wall clock) and by `serve`, greedy.

    `overlap`: the engine's request for a prompt runs on a second thread while dflash decodes
    the same prompt, for a dflash decoder on a GPU: the engine's CPU threads and the decoder's GPU
    then work at once, and neither side's figures change (the engine times its own decoding; a GPU
    decoder's host thread takes one core beside the engine's). On the CPU the two would share the
    cores, so they take turns."""
    result = ServedBenchmark(name)
    own_tokens = own_seconds = served_tokens = served_seconds = 0.0
    lengths: list[int] = []
    engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="served") if overlap else None
    try:
        for prompt in prompts:
            request = engine.submit(serve, prompt, max_new_tokens) if engine else None
            started = time.perf_counter()
            own: DecodeResult = speculative_generate(
                target, drafter, prompt, DecodeSettings(max_new_tokens, stop_ids=stop_ids)
            )
            own_seconds += time.perf_counter() - started
            own_tokens += len(own.output_ids)
            lengths += own.acceptance_lengths
            # A failed request raises here with its own traceback, and no further prompt is sent.
            served = request.result() if request else serve(prompt, max_new_tokens)
            if served.tokens_per_s > 0:
                served_tokens += len(served.output_ids)
                served_seconds += len(served.output_ids) / served.tokens_per_s
            result.prompts.append(
                agreement(
                    engine_count(own, max_new_tokens=max_new_tokens, drafts_per_round=drafts_per_round),
                    RoundCount(served.accepted, served.verifications, tuple(served.accepted_per_position)),
                    own_output=own.output_ids,
                    served_output=served.output_ids,
                )
            )
    finally:
        if engine:
            engine.shutdown(wait=True, cancel_futures=True)
    result.own_tau, _ = acceptance_figures(lengths)  # pooled over every round, as dflash-eval's
    result.own_tokens_per_s = own_tokens / max(own_seconds, 1e-9)
    result.served_tokens_per_s = served_tokens / served_seconds if served_seconds else 0.0
    return result
