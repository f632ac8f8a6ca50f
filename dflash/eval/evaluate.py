"""Speculative-decoding evaluation: decode each prompt set (dflash.eval.prompts) with DFlash
and plainly, and measure (reported by dflash.eval.report).

Per benchmark and temperature: mean tau (tokens produced per target verification), the
acceptance-length histogram, and at temperature 0 the fraction of prompts whose DFlash output
equals plain greedy output. A DSpark drafter with a confidence head adds, per block position, the
head's predicted probability that the draft there is accepted (the product of its survival
probabilities up to it) beside the share of rounds that accepted it. A DFlash2 drafter adds how
often its candidate selector drafted another token than the unary argmax, and how those drafts
fared: accepted, or rejected where the unary token was the target's choice. With timing on: time
per output token of plain (KV-cached, one token per forward) over DFlash decoding, timed with CUDA
events on GPU, after warm-up runs.

Both decoders run on the same engine (dflash.decoding: static caches, CUDA graphs on GPU) so
the speedup compares algorithms, not Python overheads (hybrid targets included); a target the
static decoder refuses (a sliding window) uses the dynamic-cache path for both. Untimed, the
plain greedy references of the lossless check may be decoded several prompts at a time
(`BatchedReferences`: the same outputs, fewer steps), and so may the DFlash decodings
(`eval.decode_streams`: one static decoder per prompt, side by side, dflash.decoding.side_by_side;
each prompt's outcome that of decoding it alone).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from dflash.config.schema import EvalConfig, VerifyRule
from dflash.decoding.continuous import ContinuousBatcher
from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import DecodeResult, drafts_per_round, plain_generate, speculative_generate
from dflash.decoding.sampling import Sampler
from dflash.decoding.side_by_side import SideBySideDecoders
from dflash.eval.journal import EvalJournal, PromptOutcome
from dflash.eval.prompts import PromptSet
from dflash.eval.report import BenchmarkResult, EvalReport, acceptance_figures
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import FrozenTarget
from dflash.stopwatch import Stopwatch

log = logging.getLogger(__name__)

T = TypeVar("T")

# on_prompt(benchmark, temperature, prompts done, prompts in the set), after each prompt.
PromptDone = Callable[[str, float, int, int], None]


def target_eos_ids(target: FrozenTarget) -> frozenset[int]:
    """The end-of-sequence ids of the target's generation_config.json (int or list, maybe unset)."""
    eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class BatchedReferences:
    """Plain greedy outputs of several prompts decoded together (continuous batching on the
    static-cache target, `slots` sequences at a time): the references of the lossless check when
    nothing is timed. A batch-1 decode spends a whole step's launches on one token; here one step
    serves `slots` prompts. The batcher (its own KV cache of `slots` rows) is built at first use
    and kept. Each output ends with its stop token, as `StaticDecoder.plain`'s does."""

    def __init__(self, target: FrozenTarget, *, slots: int, max_len: int, graphs: bool | None, compile: bool):
        self.target, self.slots, self.max_len = target, slots, max_len
        self.graphs, self.compile = graphs, compile
        self._batcher: ContinuousBatcher | None = None

    def __call__(
        self, prompts: dict[int, list[int]], max_new_tokens: int, stop_ids: frozenset[int]
    ) -> dict[int, list[int]]:
        if self._batcher is None:
            try:
                self._batcher = ContinuousBatcher(
                    self.target,
                    slots=self.slots,
                    max_len=self.max_len,
                    max_new_tokens=max_new_tokens,
                    stop_ids=stop_ids,
                    sampler=Sampler({"do_sample": False}, self.target.device, seed=0),
                    graphs=self.graphs,
                    compile=self.compile,
                )
            except torch.OutOfMemoryError as exc:
                raise ValueError(
                    f"eval.reference_slots={self.slots}: the references' KV cache of {self.slots} rows x "
                    f"{self.max_len} positions does not fit on {self.target.device}; lower it (1: one prompt "
                    f"at a time) ({exc})"
                ) from exc
        batcher = self._batcher
        batcher.configure(max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        for index, prompt in prompts.items():
            batcher.submit(index, prompt)
        outputs: dict[int, list[int]] = {}
        while batcher.busy:
            for done in batcher.step():
                outputs[done.tag] = done.tokens + ([done.stop_token] if done.stop_token is not None else [])
        return outputs


@dataclass
class Decoders:
    """DFlash and plain decoding of one prompt: `(prompt, max_new, temperature, seed, stop_ids)`;
    `load_drafter(drafter)` makes later calls decode with that drafter's weights; `prefill(prompt)`
    runs the prefill both start with, alone (None where the path has no separate prefill);
    `references`: plain greedy outputs of several prompts at once (None: one at a time, `plain`);
    `side_by_side`: DFlash decodings of several prompts at once (None: one at a time, `speculative`)."""

    speculative: Callable[..., DecodeResult]
    plain: Callable[..., DecodeResult]
    load_drafter: Callable[[DFlashDrafter], None]
    prefill: Callable[[list[int]], None] | None = None
    references: BatchedReferences | None = None
    side_by_side: SideBySideDecoders | None = None

    @classmethod
    def build(
        cls,
        target: FrozenTarget,
        drafter: DFlashDrafter,
        *,
        max_len: int,
        graphs: bool | None,
        compile: bool = False,
        sampled_drafts: bool = False,
        temperatures: tuple[float, ...] = (),
        reference_slots: int = 1,
        decode_streams: int = 1,
        verify: VerifyRule = VerifyRule.match,
    ) -> Decoders:
        """`sampled_drafts`: a DSpark or DFlash2 drafter samples its drafts at the decoding temperature (the
        static decoder captures those rounds for `temperatures` up front). `reference_slots` > 1:
        untimed greedy references decoded that many prompts at a time (static-cache targets).
        `decode_streams` > 1: untimed DFlash decodings that many prompts at a time, one static
        decoder each (static-cache targets; timed decoding uses the first alone).
        `verify=rejection` at a temperature > 0: the reference decoder, which verifies that way."""
        rejection = VerifyRule(verify) is VerifyRule.rejection and any(t > 0 for t in temperatures)
        static = None
        if rejection:
            log.info("eval.verify=rejection: decoding on the reference decoder (dflash.decoding.reference)")
        else:
            static = StaticDecoder.for_target(
                target, drafter, max_len=max_len, graphs=graphs, compile=compile
            )
        if static is not None:
            sampled = tuple(t for t in temperatures if t > 0) if sampled_drafts else ()
            static.capture_every_shape(sampled)  # outside every timed decode

            def static_speculative(prompt, max_new, temperature, seed, stop_ids):
                return static.speculative(
                    prompt, max_new, temperature, seed, stop_ids, sampled_drafts=sampled_drafts
                )

            references = None
            if reference_slots > 1:
                references = BatchedReferences(
                    target, slots=reference_slots, max_len=max_len, graphs=graphs, compile=compile
                )
            side_by_side = None
            if decode_streams > 1:
                more = [
                    StaticDecoder(target, drafter, max_len=max_len, graphs=graphs, compile=compile)
                    for _ in range(decode_streams - 1)
                ]
                for decoder in more:
                    decoder.capture_every_shape(sampled)
                side_by_side = SideBySideDecoders([static, *more], sampled_drafts=sampled_drafts)
            return cls(
                static_speculative,
                static.plain,
                side_by_side.load_drafter_weights
                if side_by_side is not None
                else static.load_drafter_weights,
                static.prefill_only,
                references,
                side_by_side,
            )
        current = {"drafter": drafter}

        def speculative(prompt, max_new, temperature, seed, stop_ids):
            return speculative_generate(
                target,
                current["drafter"],
                prompt,
                max_new,
                temperature,
                seed,
                None,
                stop_ids,
                sampled_drafts=sampled_drafts,
                verify=verify,
            )

        def plain(prompt, max_new, temperature, seed, stop_ids):
            return plain_generate(target, prompt, max_new, temperature, seed, None, stop_ids)

        return cls(speculative, plain, lambda new: current.update(drafter=new))

    @classmethod
    def for_prompts(
        cls,
        target: FrozenTarget,
        drafter: DFlashDrafter,
        prompt_sets: list[PromptSet],
        cfg: EvalConfig,
        *,
        reference_slots: int = 1,
        decode_streams: int = 1,
    ) -> Decoders:
        """Decoders sized for the longest prompt of `prompt_sets` plus `cfg.max_new_tokens`."""
        longest = max((len(p) for s in prompt_sets for p in s.prompts), default=1)
        return cls.build(
            target,
            drafter,
            max_len=longest + cfg.max_new_tokens,
            graphs=cfg.cuda_graphs,
            compile=cfg.compile_decoding,
            sampled_drafts=cfg.sampled_drafts,
            temperatures=tuple(cfg.temperatures),
            reference_slots=reference_slots,
            decode_streams=decode_streams,
            verify=cfg.verify,
        )


def evaluate_set(
    target: FrozenTarget,
    decoders: Decoders,
    prompt_set: PromptSet,
    *,
    block_size: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    timing: bool,
    warmup_prompts: int = 0,
    should_stop: Callable[[], bool] | None = None,
    on_prompt: PromptDone | None = None,
    drafts: int | None = None,
    journal: EvalJournal | None = None,
) -> BenchmarkResult:
    """Decode every prompt of the set with DFlash (and plainly when a reference or timing needs
    it); `should_stop` is asked before each prompt, and the result covers the prompts done;
    `on_prompt` hears of each prompt as it finishes. `drafts`: tokens the drafter proposes per
    round (a round produces up to drafts + 1); None: block_size - 1, a DFlash drafter's.
    `journal`: each prompt's outcome is recorded there, and a prompt it already holds is taken
    from it instead of decoded (a resumed evaluation: its time figures would cover only the
    prompts decoded here, so dflash-eval refuses a resume with timing)."""
    drafts = block_size - 1 if drafts is None else drafts
    greedy = temperature <= 0
    need_plain = greedy or timing
    stop = prompt_set.stop_ids | target_eos_ids(target)
    for prompt in prompt_set.prompts[:warmup_prompts] if timing else []:
        decoders.speculative(prompt, max_new_tokens, temperature, seed, stop)
        decoders.plain(prompt, max_new_tokens, temperature, seed, stop)
    stopwatch = Stopwatch(target.device)
    lengths: list[int] = []
    confidence = ConfidenceTally(drafts)
    selector = SelectorTally(drafts)
    # Each path's time is divided by its own output: in bf16 a greedy DFlash output may differ
    # from the plain one (near-ties) and stop at another length.
    identical, output_tokens, plain_tokens, plain_s, dflash_s, prefill_s = 0, 0, 0, 0.0, 0.0, 0.0
    divergences: list[tuple[int, float]] = []

    def seed_of(index: int) -> int:
        return seed + index

    def undecoded(index: int, count: int) -> dict[int, list[int]]:
        return _undecoded(prompt_set, temperature, journal, start=index, count=count)

    # Untimed: the greedy references decoded together, and the DFlash decodings side by side,
    # each a batch of the upcoming prompts the journal lacks at a time.
    batched = decoders.references if greedy and not timing else None
    references = None
    if batched is not None:
        references = _Ahead(batched.slots, undecoded, lambda prompts: batched(prompts, max_new_tokens, stop))
    side_by_side = decoders.side_by_side if not timing else None
    decoded = None
    if side_by_side is not None:
        unchecked = True

        def decode_together(prompts: dict[int, list[int]]) -> dict[int, DecodeResult]:
            nonlocal unchecked
            results = dict(
                zip(
                    prompts,
                    side_by_side.speculative(
                        list(prompts.values()),
                        [seed_of(index) for index in prompts],
                        max_new_tokens=max_new_tokens,
                        temperature=temperature,
                        stop_ids=stop,
                    ),
                )
            )
            if unchecked:
                _check_side_by_side(
                    decoders,
                    benchmark=prompt_set.name,
                    prompts=prompts,
                    results=results,
                    seeds=[seed_of(index) for index in prompts],
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    stop=stop,
                )
                unchecked = False
            return results

        decoded = _Ahead(side_by_side.width, undecoded, decode_together)

    def reference_of(index: int, prompt: list[int]) -> list[int]:
        """The prompt's plain output: decoded now (timed), or taken from the batch holding it."""
        nonlocal plain_s
        if references is not None:
            return references.take(index)
        reference, seconds = stopwatch(
            decoders.plain, prompt, max_new_tokens, temperature, seed_of(index), stop
        )
        plain_s += seconds
        return reference.output_ids

    def decode(index: int, prompt: list[int]) -> DecodeResult:
        """The prompt's DFlash decoding: now (timed), or taken from the side-by-side batch holding it."""
        nonlocal dflash_s
        if decoded is not None:
            return decoded.take(index)
        result, seconds = stopwatch(
            decoders.speculative, prompt, max_new_tokens, temperature, seed_of(index), stop
        )
        dflash_s += seconds
        return result

    evaluated = 0
    for index, prompt in enumerate(prompt_set.prompts):
        if should_stop is not None and should_stop():
            break
        evaluated += 1
        recorded = (
            journal.outcome(prompt_set.name, temperature, index, prompt) if journal is not None else None
        )
        if recorded is None:
            result = decode(index, prompt)
            outcome = PromptOutcome(result)
            if need_plain:
                reference_ids = reference_of(index, prompt)
                plain_tokens += len(reference_ids)
                outcome.identical = reference_ids == result.output_ids
                if greedy and not outcome.identical:
                    outcome.divergence = first_divergence(target, prompt, reference_ids, result.output_ids)
            if timing and decoders.prefill is not None:
                prefill_s += stopwatch(decoders.prefill, prompt)[1]
            if journal is not None:
                journal.record(prompt_set.name, temperature, index, prompt, outcome)
        else:
            outcome = recorded
        result = outcome.result
        lengths += result.acceptance_lengths
        confidence.add(result)
        selector.add(result)
        output_tokens += len(result.output_ids)
        identical += bool(outcome.identical)
        if outcome.divergence is not None:
            divergences.append(outcome.divergence)
        if on_prompt is not None:
            on_prompt(prompt_set.name, temperature, evaluated, len(prompt_set.prompts))
    tau, histogram = acceptance_figures(lengths, slots=drafts + 2)
    report = BenchmarkResult(
        benchmark=prompt_set.name,
        temperature=temperature,
        num_prompts=evaluated,
        output_tokens=output_tokens,
        verifications=len(lengths),
        tau=tau,
        acceptance_histogram=histogram,
        lossless_frac=identical / evaluated if greedy and evaluated else None,
        divergences=divergences,
        **confidence.fields(),
        **selector.fields(),
    )
    if timing and output_tokens and plain_tokens:
        report.plain_ms_per_token = 1000.0 * plain_s / plain_tokens
        report.dflash_ms_per_token = 1000.0 * dflash_s / output_tokens
        report.speedup = report.plain_ms_per_token / report.dflash_ms_per_token
        # A DFlash round (draft + verify + bookkeeping) in plain decoding steps, both without the
        # prefill (its first token included): what scripts/bench_decode.py's round measures.
        # speedup ~ tau / round_cost when prefills are short beside the decoding, so this says
        # whether a low speedup is tau, the decoder, or prefills.
        report.prefill_ms = 1000.0 * prefill_s / evaluated if prefill_s else None
        steps = max(1, plain_tokens - evaluated)
        report.round_cost = ((dflash_s - prefill_s) / max(1, len(lengths))) / ((plain_s - prefill_s) / steps)
        report.timing_device = str(target.device)
    return report


def _check_side_by_side(
    decoders: Decoders,
    *,
    benchmark: str,
    prompts: dict[int, list[int]],
    results: dict[int, DecodeResult],
    seeds: list[int],
    max_new_tokens: int,
    temperature: float,
    stop: frozenset[int],
) -> None:
    """The first side-by-side batch of a benchmark and temperature decoded again one prompt at a
    time: decoders replaying at once on one GPU must not change an outcome (graphs sharing scratch
    memory once did), and no figure comes from that path unless it held here, on this device."""
    for (index, prompt), seed in zip(prompts.items(), seeds):
        alone = decoders.speculative(prompt, max_new_tokens, temperature, seed, stop)
        if alone != results[index]:
            raise ValueError(
                f"eval.decode_streams={decoders.side_by_side.width}: prompt {index} of {benchmark!r} "
                f"(temperature {temperature}) decoded side by side differs from decoding it alone on "
                "this device; set eval.decode_streams=1"
            )


class _Ahead(Generic[T]):
    """Outcomes of upcoming prompts decoded as a batch: `take(index)` gives prompt `index`'s,
    first decoding the next `width` prompts from `index` on that `undecoded` names (the ones the
    journal lacks) when the batch in hand does not hold it."""

    def __init__(
        self,
        width: int,
        undecoded: Callable[[int, int], dict[int, list[int]]],
        decode_batch: Callable[[dict[int, list[int]]], dict[int, T]],
    ):
        self.width, self.undecoded, self.decode_batch = width, undecoded, decode_batch
        self.held: dict[int, T] = {}

    def take(self, index: int) -> T:
        if index not in self.held:
            self.held = self.decode_batch(self.undecoded(index, self.width))
        return self.held.pop(index)


def _undecoded(
    prompt_set: PromptSet, temperature: float, journal: EvalJournal | None, *, start: int, count: int
) -> dict[int, list[int]]:
    """The next `count` prompts from `start` on that the journal does not hold, by index."""
    upcoming: dict[int, list[int]] = {}
    for index in range(start, len(prompt_set.prompts)):
        prompt = prompt_set.prompts[index]
        if journal is None or not journal.holds(prompt_set.name, temperature, index):
            upcoming[index] = prompt
            if len(upcoming) == count:
                break
    return upcoming


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


def planned_decodings(prompt_sets: list[PromptSet], cfg: EvalConfig) -> int:
    """Prompt decodings `evaluate` makes when nothing stops it: every prompt at every temperature."""
    return sum(len(prompt_set.prompts) for prompt_set in prompt_sets) * len(cfg.temperatures)


@torch.no_grad()
def first_divergence(
    target: FrozenTarget, prompt: list[int], plain: list[int], dflash: list[int]
) -> tuple[int, float]:
    """Where two greedy outputs first differ, and the target's logit gap between the two tokens
    there (one uncached forward over the common prefix)."""
    index = next(i for i, (a, b) in enumerate(zip(plain, dflash)) if a != b)
    ids = torch.tensor([prompt + plain[:index]], device=target.device)
    logits = target(ids).logits[0, -1].float()
    return index, round(float(logits[plain[index]] - logits[dflash[index]]), 5)


def evaluate(
    target: FrozenTarget,
    drafter: DFlashDrafter,
    prompt_sets: list[PromptSet],
    cfg: EvalConfig,
    timing: bool,
    should_stop: Callable[[], bool] | None = None,
    decoders: Decoders | None = None,
    on_prompt: PromptDone | None = None,
    journal: EvalJournal | None = None,
) -> EvalReport:
    """Every prompt set at every temperature; `should_stop` (a signal) ends it early with what
    was evaluated, `interrupted` set. `decoders`: built by an earlier call with these prompt
    sets (`Decoders.for_prompts`), loaded with this drafter's weights and reused. `on_prompt`:
    called after each prompt (progress for a long evaluation). `journal`: evaluate_set's."""
    if next(drafter.parameters()).device != target.device:
        drafter = copy.deepcopy(drafter).to(target.device)  # gpu=split: replicas live elsewhere
    was_training = drafter.training
    drafter.eval()
    try:
        if decoders is None:
            decoders = Decoders.for_prompts(target, drafter, prompt_sets, cfg)
        else:
            decoders.load_drafter(drafter)
        report = EvalReport()
        for temperature in cfg.temperatures:
            for prompt_set in prompt_sets:
                result = evaluate_set(
                    target,
                    decoders,
                    prompt_set,
                    block_size=drafter.block_size,
                    drafts=drafts_per_round(drafter),
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=temperature,
                    seed=cfg.seed,
                    timing=timing,
                    warmup_prompts=cfg.warmup_prompts,
                    should_stop=should_stop,
                    on_prompt=on_prompt,
                    journal=journal,
                )
                if result.num_prompts:
                    report.results.append(result)
                if should_stop is not None and should_stop():
                    report.interrupted = True
                    return report
        return report
    finally:
        drafter.train(was_training)
