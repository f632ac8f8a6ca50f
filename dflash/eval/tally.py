"""A prompt set's figures, added one prompt's outcome at a time (dflash.eval.evaluate): the
acceptance lengths, output tokens and greedy losslessness every drafter has, the per-round
figures a drafter records on its decodings (`DFlashDrafter.add_round_figures`: a DSpark
confidence head's predictions, a DFlash2 selector's changes), each tallied by the tally of that
figure, and the seconds each decoding path took."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dflash.decoding.reference import DecodeResult
from dflash.eval.journal import PromptOutcome
from dflash.eval.results import BenchmarkResult, acceptance_figures


class RoundFigureTally(Protocol):
    """A tally of per-round figures a drafter records on its `DecodeResult`s: `add` each
    decoding, `fields` the BenchmarkResult fields it fills ({} when no round recorded any)."""

    def add(self, result: DecodeResult) -> None: ...

    def fields(self) -> dict: ...


class ConfidenceTally:
    """A DSpark confidence head's predictions against the acceptance measured, over rounds: per
    block position k, the predicted probability that draft k is accepted (the product of the
    head's survival probabilities c_0..c_k, DeepSpec's reading of it) and the share of rounds that
    accepted at least k + 1 drafts."""

    def __init__(self, drafts: int):
        self.predicted = np.zeros(drafts)
        self.accepted = np.zeros(drafts)
        self.rounds = 0

    def add(self, result: DecodeResult) -> None:
        if not result.confidence:
            return
        survival = np.cumprod(np.asarray(result.confidence, dtype=np.float64), axis=1)
        self.predicted += survival.sum(axis=0)
        drafted = np.arange(len(self.accepted))
        self.accepted += (np.asarray(result.accepted_drafts)[: len(survival), None] > drafted).sum(axis=0)
        self.rounds += len(survival)

    def fields(self) -> dict:
        """BenchmarkResult's confidence fields ({} without a confidence head)."""
        if not self.rounds:
            return {}
        predicted, accepted = self.predicted / self.rounds, self.accepted / self.rounds
        return {
            "confidence_by_position": [round(float(p), 4) for p in predicted],
            "accepted_by_position": [round(float(a), 4) for a in accepted],
            # 1 + expected accepted drafts, as predicted and as measured (rounds uncut by the
            # output's end, so beside each other rather than beside tau).
            "confidence_tau": float(1 + predicted.sum()),
            "accepted_tau": float(1 + accepted.sum()),
        }


class SelectorTally:
    """A DFlash2 candidate selector against the unary argmax it may override, over rounds
    (`DecodeResult.selector_changed` ...): the share of draft positions where it drafted another
    token; of those drafts, the share accepted and the share rejected where the unary token was
    the target's choice (keeping it would have had that draft accepted)."""

    def __init__(self, drafts: int):
        self.drafts = drafts
        self.rounds = self.changed = self.accepted = self.unary_right = 0

    def add(self, result: DecodeResult) -> None:
        self.rounds += len(result.selector_changed)
        self.changed += sum(result.selector_changed)
        self.accepted += sum(result.selector_changed_accepted)
        self.unary_right += sum(result.selector_changed_unary_right)

    def fields(self) -> dict:
        """BenchmarkResult's selector fields ({} without a DFlash2 drafter; the two shares of
        changes None when the selector changed nothing)."""
        if not self.rounds:
            return {}
        return {
            "selector_change_frac": round(self.changed / (self.rounds * self.drafts), 4),
            "selector_change_accepted_frac": round(self.accepted / self.changed, 4) if self.changed else None,
            "selector_change_unary_frac": round(self.unary_right / self.changed, 4) if self.changed else None,
        }


# The tallies of the per-round figures a DecodeResult can carry; each fills no field for a
# drafter that records none of its figures.
ROUND_FIGURE_TALLIES: tuple[type[RoundFigureTally], ...] = (ConfidenceTally, SelectorTally)


class OutcomeTally:
    """The figures of a prompt set's outcomes at one temperature: tau and the acceptance
    histogram over every round, output tokens, greedy losslessness and divergences, and each
    per-round figure tally's fields."""

    def __init__(self, drafts: int):
        self.drafts = drafts
        self.prompts = self.output_tokens = self.identical = 0
        self.lengths: list[int] = []
        self.divergences: list[tuple[int, float]] = []
        self.round_figures = [tally(drafts) for tally in ROUND_FIGURE_TALLIES]

    def add(self, outcome: PromptOutcome) -> None:
        self.prompts += 1
        result = outcome.result
        self.lengths += result.acceptance_lengths
        for tally in self.round_figures:
            tally.add(result)
        self.output_tokens += len(result.output_ids)
        self.identical += bool(outcome.identical)
        if outcome.divergence is not None:
            self.divergences.append(outcome.divergence)

    def result(self, *, benchmark: str, temperature: float) -> BenchmarkResult:
        """The set's BenchmarkResult, its time figures unset (`DecodeTimes.fill`)."""
        greedy = temperature <= 0
        tau, histogram = acceptance_figures(self.lengths, slots=self.drafts + 2)
        figures = {name: value for tally in self.round_figures for name, value in tally.fields().items()}
        return BenchmarkResult(
            benchmark=benchmark,
            temperature=temperature,
            num_prompts=self.prompts,
            output_tokens=self.output_tokens,
            verifications=len(self.lengths),
            tau=tau,
            acceptance_histogram=histogram,
            lossless_frac=self.identical / self.prompts if greedy and self.prompts else None,
            divergences=self.divergences,
            **figures,
        )


@dataclass
class DecodeTimes:
    """Seconds each path spent on the prompts decoded here (not those a journal held), and the
    plain path's output tokens. Each path's time is divided by its own output: in bf16 a greedy
    DFlash output may differ from the plain one (near-ties) and stop at another length."""

    plain_s: float = 0.0
    dflash_s: float = 0.0
    prefill_s: float = 0.0
    plain_tokens: int = 0

    def fill(self, report: BenchmarkResult, *, device: str) -> None:
        """The report's time figures, where both paths produced output."""
        if not (report.output_tokens and self.plain_tokens):
            return
        report.plain_ms_per_token = 1000.0 * self.plain_s / self.plain_tokens
        report.dflash_ms_per_token = 1000.0 * self.dflash_s / report.output_tokens
        report.speedup = report.plain_ms_per_token / report.dflash_ms_per_token
        # A DFlash round (draft + verify + bookkeeping) in plain decoding steps, both without the
        # prefill (its first token included): what scripts/bench_decode.py's round measures.
        # speedup ~ tau / round_cost when prefills are short beside the decoding, so this says
        # whether a low speedup is tau, the decoder, or prefills.
        evaluated = report.num_prompts
        report.prefill_ms = 1000.0 * self.prefill_s / evaluated if self.prefill_s else None
        steps = max(1, self.plain_tokens - evaluated)
        rounds = max(1, report.verifications)
        report.round_cost = ((self.dflash_s - self.prefill_s) / rounds) / (
            (self.plain_s - self.prefill_s) / steps
        )
        report.timing_device = device
