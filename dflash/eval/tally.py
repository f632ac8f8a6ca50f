"""A prompt set's figures, added one prompt's outcome at a time (dflash.eval.evaluate): the
acceptance lengths, output tokens and greedy losslessness every drafter has, the per-round
figures a drafter records on its decodings (`DFlashDrafter.add_round_figures`), tallied by the
tally the drafter names (`DFlashDrafter.round_tally`), and the seconds each decoding path took.
Nothing here knows which figures a variant records."""

from __future__ import annotations

from dataclasses import dataclass

from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.round_tally import RoundTally
from dflash.eval.journal import PromptOutcome
from dflash.eval.results import BenchmarkResult, acceptance_figures


class OutcomeTally:
    """The figures of a prompt set's outcomes at one temperature: tau and the acceptance
    histogram over every round, output tokens, greedy losslessness and divergences, and the
    fields of the drafter's own per-round figure tally (`round_tally`, None: the drafter records
    no per-round figures)."""

    def __init__(self, drafts: int, round_tally: type[RoundTally] | None = None):
        self.drafts = drafts
        self.prompts = self.output_tokens = self.identical = 0
        self.lengths: list[int] = []
        self.divergences: list[tuple[int, float]] = []
        self.round_figures = None if round_tally is None else round_tally(drafts)

    @classmethod
    def of(cls, drafter: DFlashDrafter) -> OutcomeTally:
        """The tally of a drafter's decodings: its drafts per round and its round figures' tally."""
        return cls(drafter.drafts_per_block, drafter.round_tally)

    def add(self, outcome: PromptOutcome) -> None:
        self.prompts += 1
        result = outcome.result
        self.lengths += result.acceptance_lengths
        if self.round_figures is not None:
            self.round_figures.add(result)
        self.output_tokens += len(result.output_ids)
        self.identical += bool(outcome.identical)
        if outcome.divergence is not None:
            self.divergences.append(outcome.divergence)

    def result(self, *, benchmark: str, temperature: float) -> BenchmarkResult:
        """The set's BenchmarkResult, its time figures unset (`DecodeTimes.fill`)."""
        greedy = temperature <= 0
        tau, histogram = acceptance_figures(self.lengths, slots=self.drafts + 2)
        report = BenchmarkResult(
            benchmark=benchmark,
            temperature=temperature,
            num_prompts=self.prompts,
            output_tokens=self.output_tokens,
            verifications=len(self.lengths),
            tau=tau,
            acceptance_histogram=histogram,
            lossless_frac=self.identical / self.prompts if greedy and self.prompts else None,
            divergences=self.divergences,
        )
        if self.round_figures is not None:
            report.add_figures(self.round_figures.fields())
        return report


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
