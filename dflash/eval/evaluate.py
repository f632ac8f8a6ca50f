"""Speculative-decoding evaluation: decode each prompt set (dflash.eval.prompt_sets) with DFlash
and plainly, and measure (reported by dflash.eval.results).

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
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import torch

from dflash.config.schema import EvalConfig, VerifyRule
from dflash.decoding.continuous import ContinuousBatcher
from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import DecodeResult, plain_generate, speculative_generate
from dflash.decoding.sampling import Sampler
from dflash.decoding.settings import DecodeSettings
from dflash.decoding.side_by_side import SideBySideDecoders
from dflash.drafters.backbone import DFlashDrafter
from dflash.eval.journal import EvalJournal, PromptOutcome
from dflash.eval.prompt_sets import PromptSet
from dflash.eval.results import BenchmarkResult, EvalReport
from dflash.eval.tally import DecodeTimes, OutcomeTally
from dflash.stopwatch import Stopwatch
from dflash.target.model import FrozenTarget

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
    """DFlash and plain decoding of one prompt: `(prompt, settings)`, settings a DecodeSettings;
    `load_drafter(drafter)` makes later calls decode with that drafter's weights; `prefill(prompt)`
    runs the prefill both start with, alone (None where the path has no separate prefill);
    `references`: plain greedy outputs of several prompts at once (None: one at a time, `plain`);
    `side_by_side`: DFlash decodings of several prompts at once (None: one at a time, `speculative`)."""

    speculative: Callable[[list[int], DecodeSettings], DecodeResult]
    plain: Callable[[list[int], DecodeSettings], DecodeResult]
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
        if VerifyRule(verify) is VerifyRule.rejection and any(t > 0 for t in temperatures):
            log.info("eval.verify=rejection: decoding on the reference decoder (dflash.decoding.reference)")
        else:
            static = StaticDecoder.for_target(
                target, drafter, max_len=max_len, graphs=graphs, compile=compile
            )
            if static is not None:
                return cls._static(
                    target,
                    drafter,
                    static,
                    max_len=max_len,
                    graphs=graphs,
                    compile=compile,
                    sampled_drafts=sampled_drafts,
                    temperatures=temperatures,
                    reference_slots=reference_slots,
                    decode_streams=decode_streams,
                )
        current = {"drafter": drafter}

        def speculative(prompt: list[int], settings: DecodeSettings) -> DecodeResult:
            return speculative_generate(
                target, current["drafter"], prompt, settings, sampled_drafts=sampled_drafts, verify=verify
            )

        def plain(prompt: list[int], settings: DecodeSettings) -> DecodeResult:
            return plain_generate(target, prompt, settings)

        return cls(speculative, plain, lambda new: current.update(drafter=new))

    @classmethod
    def _static(
        cls,
        target: FrozenTarget,
        drafter: DFlashDrafter,
        static: StaticDecoder,
        *,
        max_len: int,
        graphs: bool | None,
        compile: bool,
        sampled_drafts: bool,
        temperatures: tuple[float, ...],
        reference_slots: int,
        decode_streams: int,
    ) -> Decoders:
        """Decoders on the static decoder `static` (`build`'s arguments), every shape captured."""
        sampled = tuple(t for t in temperatures if t > 0) if sampled_drafts else ()
        static.capture_every_shape(sampled)  # outside every timed decode

        def static_speculative(prompt: list[int], settings: DecodeSettings) -> DecodeResult:
            return static.speculative(prompt, settings, sampled_drafts=sampled_drafts)

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
            side_by_side.load_drafter_weights if side_by_side is not None else static.load_drafter_weights,
            static.prefill_only,
            references,
            side_by_side,
        )

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
    drafter: DFlashDrafter | None = None,
    journal: EvalJournal | None = None,
) -> BenchmarkResult:
    """Decode every prompt of the set with DFlash (and plainly when a reference or timing needs
    it); `should_stop` is asked before each prompt, and the result covers the prompts done;
    `on_prompt` hears of each prompt as it finishes. `drafter`: the one decoding, whose drafts per
    round and per-round figures the result reports (None: block_size - 1 drafts, no figures).
    `journal`: each prompt's outcome is recorded there, and a prompt it already holds is taken
    from it instead of decoded (a resumed evaluation: its time figures would cover only the
    prompts decoded here, so dflash-eval refuses a resume with timing)."""
    stop = prompt_set.stop_ids | target_eos_ids(target)
    settings = DecodeSettings(max_new_tokens, temperature=temperature, seed=seed, stop_ids=stop)
    for prompt in prompt_set.prompts[:warmup_prompts] if timing else []:
        decoders.speculative(prompt, settings)
        decoders.plain(prompt, settings)
    decoding = _SetDecoding(target, decoders, prompt_set, settings=settings, timing=timing, journal=journal)
    tally = OutcomeTally(block_size - 1) if drafter is None else OutcomeTally.of(drafter)
    for index, prompt in enumerate(prompt_set.prompts):
        if should_stop is not None and should_stop():
            break
        recorded = (
            journal.outcome(prompt_set.name, temperature, index, prompt) if journal is not None else None
        )
        if recorded is None:
            recorded = decoding.outcome(index, prompt)
            if journal is not None:
                journal.record(prompt_set.name, temperature, index, prompt, recorded)
        tally.add(recorded)
        if on_prompt is not None:
            on_prompt(prompt_set.name, temperature, tally.prompts, len(prompt_set.prompts))
    report = tally.result(benchmark=prompt_set.name, temperature=temperature)
    if timing:
        decoding.times.fill(report, device=str(target.device))
    return report


class _SetDecoding:
    """Each prompt's outcome, decoded: DFlash, and plain where a greedy reference or timing
    needs it. Timed, one prompt at a time on the stopwatch (`times`); untimed, the greedy
    references decoded together and the DFlash decodings side by side where the decoders offer
    them, each a batch of the upcoming prompts the journal lacks at a time. `settings`: the set's,
    its seed that of prompt 0 (prompt i decodes with seed + i, wherever it is decoded)."""

    def __init__(
        self,
        target: FrozenTarget,
        decoders: Decoders,
        prompt_set: PromptSet,
        *,
        settings: DecodeSettings,
        timing: bool,
        journal: EvalJournal | None,
    ):
        self.target, self.decoders, self.prompt_set = target, decoders, prompt_set
        self.settings, self.timing, self.journal = settings, timing, journal
        self.greedy = settings.temperature <= 0
        self.stopwatch = Stopwatch(target.device)
        self.times = DecodeTimes()
        batched = decoders.references if self.greedy and not timing else None
        self.references = None
        if batched is not None:
            self.references = _Ahead(
                batched.slots,
                self._undecoded,
                lambda prompts: batched(prompts, settings.max_new_tokens, settings.stop_ids),
            )
        side_by_side = decoders.side_by_side if not timing else None
        self.decoded = (
            None if side_by_side is None else _Ahead(side_by_side.width, self._undecoded, self._together)
        )
        self.unchecked = True

    def _undecoded(self, index: int, count: int) -> dict[int, list[int]]:
        return _undecoded(self.prompt_set, self.settings.temperature, self.journal, start=index, count=count)

    def _prompt_settings(self, index: int) -> DecodeSettings:
        return replace(self.settings, seed=self.settings.seed + index)

    def _together(self, prompts: dict[int, list[int]]) -> dict[int, DecodeResult]:
        """DFlash decodings of `prompts` side by side; the first batch checked against decoding alone."""
        settings = [self._prompt_settings(index) for index in prompts]
        decoded = self.decoders.side_by_side.speculative(list(prompts.values()), settings)
        results = dict(zip(prompts, decoded))
        if self.unchecked:
            _check_side_by_side(
                self.decoders,
                benchmark=self.prompt_set.name,
                prompts=prompts,
                results=results,
                settings=settings,
            )
            self.unchecked = False
        return results

    def _timed(
        self, decode: Callable[[list[int], DecodeSettings], DecodeResult], index: int, prompt: list[int]
    ) -> tuple[DecodeResult, float]:
        return self.stopwatch(decode, prompt, self._prompt_settings(index))

    def _reference(self, index: int, prompt: list[int]) -> list[int]:
        """The prompt's plain output: decoded now (timed), or taken from the batch holding it."""
        if self.references is not None:
            return self.references.take(index)
        reference, seconds = self._timed(self.decoders.plain, index, prompt)
        self.times.plain_s += seconds
        return reference.output_ids

    def _speculative(self, index: int, prompt: list[int]) -> DecodeResult:
        """The prompt's DFlash decoding: now (timed), or taken from the side-by-side batch holding it."""
        if self.decoded is not None:
            return self.decoded.take(index)
        result, seconds = self._timed(self.decoders.speculative, index, prompt)
        self.times.dflash_s += seconds
        return result

    def outcome(self, index: int, prompt: list[int]) -> PromptOutcome:
        result = self._speculative(index, prompt)
        outcome = PromptOutcome(result)
        if self.greedy or self.timing:
            reference_ids = self._reference(index, prompt)
            self.times.plain_tokens += len(reference_ids)
            outcome.identical = reference_ids == result.output_ids
            if self.greedy and not outcome.identical:
                outcome.divergence = first_divergence(self.target, prompt, reference_ids, result.output_ids)
        if self.timing and self.decoders.prefill is not None:
            self.times.prefill_s += self.stopwatch(self.decoders.prefill, prompt)[1]
        return outcome


def _check_side_by_side(
    decoders: Decoders,
    *,
    benchmark: str,
    prompts: dict[int, list[int]],
    results: dict[int, DecodeResult],
    settings: list[DecodeSettings],
) -> None:
    """The first side-by-side batch of a benchmark and temperature decoded again one prompt at a
    time: decoders replaying at once on one GPU must not change an outcome (graphs sharing scratch
    memory once did), and no figure comes from that path unless it held here, on this device."""
    for (index, prompt), each in zip(prompts.items(), settings):
        alone = decoders.speculative(prompt, each)
        if alone != results[index]:
            raise ValueError(
                f"eval.decode_streams={decoders.side_by_side.width}: prompt {index} of {benchmark!r} "
                f"(temperature {each.temperature}) decoded side by side differs from decoding it alone on "
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
                    drafter=drafter,
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
