"""Speculative-decoding evaluation: acceptance length, its histogram, losslessness, speedup.

Prompt sets: `eval.benchmarks` maps a benchmark name to a local JSONL file, one prompt per
line ({"prompt": "..."} as one user turn, {"turns": [...]} whose first turn is used, or a
conversation in either training shape, cut before its first reply), rendered with the
target's chat template; `package:humaneval` / `package:mtbench` read the files installed
packages ship (dflash.data.benchmarks). Without benchmark files (a
random-init target has no tokenizer), one set of random held-out token prompts.

Per benchmark and temperature: mean tau (tokens produced per target verification), the
acceptance-length histogram, and at temperature 0 the fraction of prompts whose DFlash output
equals plain greedy output. With timing on: time per output token of plain (KV-cached, one
token per forward) over DFlash decoding, timed with CUDA events on GPU, after warm-up runs.

Both decoders run on the same engine (dflash.decoding: static caches, CUDA graphs on GPU) so
the speedup compares algorithms, not Python overheads; hybrid targets use the dynamic-cache
path for both.
"""

from __future__ import annotations

import copy
import gzip
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from jinja2 import TemplateError

from dflash.config.schema import EvalConfig
from dflash.data.benchmarks import is_packaged, packaged_prompts
from dflash.data.conversations import MalformedRecord, normalize
from dflash.data.synthetic import random_prompts
from dflash.decoding.engine import StaticDecoder
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import FrozenTarget
from dflash.spec_decode import DecodeResult, plain_generate, speculative_generate

RANDOM_SET = "heldout"


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]]
    # Decoding of a prompt ends at any of these (the tokenizer's end of turn); with the target's
    # generation_config eos ids added at evaluation.
    stop_ids: frozenset[int] = frozenset()


def read_prompt_file(name: str, path: str, renderer: Any, limit: int) -> PromptSet:
    """The first `limit` prompts of a JSONL benchmark file (or .jsonl.gz, or `package:<name>`
    for a file shipped in an installed package), as chat-template token ids."""
    template = "{prompt}"
    if is_packaged(path):
        located, template = packaged_prompts(f"eval.benchmarks.{name}", path)
        path = str(located)
    if not Path(path).is_file():
        raise ValueError(f"eval.benchmarks.{name}: {path} is not a file")
    prompts = []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if len(prompts) == limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if isinstance(record, dict) and ("prompt" in record or "turns" in record):
                    text = record["prompt"] if "prompt" in record else record["turns"][0]
                    messages = [{"role": "user", "content": template.format(prompt=text)}]
                else:  # a conversation (OpenAI or ShareGPT): everything before its first reply
                    messages = []
                    for message in normalize(record, need_reply=False)[0]:
                        if message["role"] == "assistant":
                            break
                        messages.append(message)
                    if not messages or messages[-1]["role"] != "user":
                        raise MalformedRecord("no user turn before the first reply")
                prompts.append(renderer.prompt_ids(messages))
            except (
                json.JSONDecodeError,
                MalformedRecord,
                TemplateError,
                KeyError,
                IndexError,
                TypeError,
            ) as exc:
                raise ValueError(
                    f"eval.benchmarks.{name}: {path}:{line_no}: expected {{'prompt': str}}, "
                    f"{{'turns': [...]}} or a conversation ({type(exc).__name__}: {exc})"
                ) from exc
    if not prompts:
        raise ValueError(f"eval.benchmarks.{name}: {path} holds no prompt")
    eos = renderer.tokenizer.eos_token_id
    return PromptSet(name, prompts, frozenset() if eos is None else frozenset([eos]))


def load_prompt_sets(
    cfg: EvalConfig, renderer_factory: Callable[[], Any], vocab_size: int, excluded: list[int], limit: int
) -> list[PromptSet]:
    if cfg.benchmarks:
        renderer = renderer_factory()
        return [read_prompt_file(n, p, renderer, limit) for n, p in sorted(cfg.benchmarks.items())]
    rng = np.random.default_rng(cfg.seed)
    prompts = random_prompts(limit, cfg.prompt_len, cfg.prompt_len, vocab_size, excluded, rng)
    return [PromptSet(RANDOM_SET, [p.tolist() for p in prompts])]


@dataclass
class BenchmarkResult:
    benchmark: str
    temperature: float
    num_prompts: int
    output_tokens: int
    verifications: int  # target forwards after the prefill
    tau: float
    # histogram[k] = share of verifications that produced k tokens (index 0 unused).
    acceptance_histogram: list[float]
    lossless_frac: float | None = None  # temperature 0 only
    # Greedy outputs that differ: (first differing position, target logit gap there between the
    # plain token and the DFlash token). A gap at the dtype's resolution is a numerical tie that
    # batched verification and one-token decoding break differently, not an accepted bad draft.
    divergences: list[tuple[int, float]] = field(default_factory=list)
    plain_ms_per_token: float | None = None
    dflash_ms_per_token: float | None = None
    speedup: float | None = None
    timing_device: str | None = None


def target_eos_ids(target: FrozenTarget) -> frozenset[int]:
    """The end-of-sequence ids of the target's generation_config.json (int or list, maybe unset)."""
    eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class Stopwatch:
    """Elapsed seconds of a callable: CUDA events on GPU (no host sync inside), else wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[..., DecodeResult], *args: Any) -> tuple[DecodeResult, float]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args)
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end) / 1000.0
        started = time.perf_counter()
        result = fn(*args)
        return result, time.perf_counter() - started


@dataclass
class Decoders:
    """DFlash and plain decoding of one prompt: `(prompt, max_new, temperature, seed, stop_ids)`."""

    speculative: Callable[..., DecodeResult]
    plain: Callable[..., DecodeResult]

    @classmethod
    def build(
        cls,
        target: FrozenTarget,
        drafter: DFlashDrafter,
        *,
        max_len: int,
        graphs: bool | None,
        compile: bool = False,
    ) -> Decoders:
        static = StaticDecoder.for_target(target, drafter, max_len=max_len, graphs=graphs, compile=compile)
        if static is not None:
            return cls(static.speculative, static.plain)

        def speculative(prompt, max_new, temperature, seed, stop_ids):
            return speculative_generate(target, drafter, prompt, max_new, temperature, seed, None, stop_ids)

        def plain(prompt, max_new, temperature, seed, stop_ids):
            return plain_generate(target, prompt, max_new, temperature, seed, None, stop_ids)

        return cls(speculative, plain)


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
) -> BenchmarkResult:
    """Decode every prompt of the set with DFlash (and plainly when a reference or timing needs
    it); `should_stop` is asked before each prompt, and the result covers the prompts done."""
    greedy = temperature <= 0
    need_plain = greedy or timing
    stop = prompt_set.stop_ids | target_eos_ids(target)
    for prompt in prompt_set.prompts[:warmup_prompts] if timing else []:
        decoders.speculative(prompt, max_new_tokens, temperature, seed, stop)
        decoders.plain(prompt, max_new_tokens, temperature, seed, stop)
    stopwatch = Stopwatch(target.device)
    lengths: list[int] = []
    identical, output_tokens, plain_s, dflash_s = 0, 0, 0.0, 0.0
    divergences: list[tuple[int, float]] = []
    evaluated = 0
    for index, prompt in enumerate(prompt_set.prompts):
        if should_stop is not None and should_stop():
            break
        evaluated += 1
        prompt_seed = seed + index
        result, seconds = stopwatch(
            decoders.speculative, prompt, max_new_tokens, temperature, prompt_seed, stop
        )
        dflash_s += seconds
        lengths += result.acceptance_lengths
        output_tokens += len(result.output_ids)
        if need_plain:
            reference, seconds = stopwatch(
                decoders.plain, prompt, max_new_tokens, temperature, prompt_seed, stop
            )
            plain_s += seconds
            if reference.output_ids == result.output_ids:
                identical += 1
            elif greedy:
                divergences.append(first_divergence(target, prompt, reference.output_ids, result.output_ids))
    histogram = np.bincount(lengths, minlength=block_size + 1) / max(1, len(lengths))
    report = BenchmarkResult(
        benchmark=prompt_set.name,
        temperature=temperature,
        num_prompts=evaluated,
        output_tokens=output_tokens,
        verifications=len(lengths),
        tau=float(np.mean(lengths)) if lengths else 0.0,
        acceptance_histogram=[round(float(h), 4) for h in histogram],
        lossless_frac=identical / evaluated if greedy and evaluated else None,
        divergences=divergences,
    )
    if timing and output_tokens:
        report.plain_ms_per_token = 1000.0 * plain_s / output_tokens
        report.dflash_ms_per_token = 1000.0 * dflash_s / output_tokens
        report.speedup = plain_s / dflash_s
        report.timing_device = str(target.device)
    return report


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


def lossless_line(metrics: dict[str, float]) -> str:
    if metrics["eval/lossless_frac"] == 1.0:
        return "yes: greedy DFlash output identical to plain greedy output"
    return (
        f"NO: {1 - metrics['eval/lossless_frac']:.0%} of greedy DFlash outputs differ from plain greedy "
        f"output; at each first difference the target's logit gap between the two tokens is <= "
        f"{metrics.get('eval/divergence_max_logit_gap', float('nan')):.4f}. In bf16, tokens that close "
        "can swap between batched verification and one-token decoding; target.dtype=float32 is the "
        "exact check"
    )


@dataclass
class EvalReport:
    results: list[BenchmarkResult] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False  # stopped early (a signal): the results cover the prompts done

    def greedy(self) -> list[BenchmarkResult]:
        return [r for r in self.results if r.temperature <= 0]

    def metrics(self) -> dict[str, float]:
        """Flat floats for the monitor / summary: eval/tau and eval/lossless_frac over the
        greedy results, per-benchmark eval/<name>/tau, the pooled acceptance histogram."""
        greedy = self.greedy() or self.results
        if not greedy:
            return {"eval/num_prompts": 0.0}
        weights = np.array([r.output_tokens for r in greedy], dtype=float)
        taus = np.array([r.tau for r in greedy])
        out = {
            "eval/tau": float(np.average(taus, weights=weights)) if weights.sum() else 0.0,
            "eval/num_prompts": float(sum(r.num_prompts for r in greedy)),
        }
        lossless = [r.lossless_frac for r in greedy if r.lossless_frac is not None]
        if lossless:
            out["eval/lossless_frac"] = float(np.mean(lossless))
        gaps = [abs(gap) for r in greedy for _, gap in r.divergences]
        if gaps:
            out["eval/divergence_max_logit_gap"] = max(gaps)
        for r in self.results:
            suffix = "" if r.temperature <= 0 else f"_t{r.temperature:g}"
            out[f"eval/{r.benchmark}/tau{suffix}"] = r.tau
            if r.speedup is not None:
                out[f"eval/{r.benchmark}/speedup{suffix}"] = r.speedup
        counts = sum(np.array(r.acceptance_histogram) * r.verifications for r in greedy)
        pooled = counts / max(1, sum(r.verifications for r in greedy))
        for k in range(1, len(pooled)):
            out[f"eval/accept_len_{k}_frac"] = float(pooled[k])
        return out

    def table(self) -> str:
        header = (
            f"{'benchmark':<14}{'temp':>6}{'prompts':>9}{'tau':>8}{'lossless':>10}"
            f"{'plain ms/tok':>14}{'dflash ms/tok':>15}{'speedup':>9}"
        )
        rows = [header, "-" * len(header)]
        for r in self.results:
            lossless = "-" if r.lossless_frac is None else f"{r.lossless_frac:.0%}"
            timing = (
                f"{r.plain_ms_per_token:>14.2f}{r.dflash_ms_per_token:>15.2f}{r.speedup:>8.2f}x"
                if r.speedup is not None
                else f"{'-':>14}{'-':>15}{'-':>9}"
            )
            rows.append(
                f"{r.benchmark:<14}{r.temperature:>6g}{r.num_prompts:>9}{r.tau:>8.3f}{lossless:>10}{timing}"
            )
        for r in self.results:
            if r.divergences:
                gaps = [abs(gap) for _, gap in r.divergences]
                rows.append(
                    f"{r.benchmark}: {len(r.divergences)} greedy outputs differ from plain decoding; first "
                    f"difference at tokens {[i for i, _ in r.divergences]}, target logit gap between the two there "
                    f"max {max(gaps):.4f}"
                )
        rows.append("")
        rows.append("acceptance-length histogram (share of verifications producing k tokens):")
        for r in self.results:
            cells = " ".join(f"{k}:{h:.2f}" for k, h in enumerate(r.acceptance_histogram) if k >= 1)
            rows.append(f"  {r.benchmark} t={r.temperature:g}  {cells}")
        return "\n".join(rows)

    def lossless_line(self) -> str | None:
        """One line on the greedy check, with the reading of a failure (None without greedy runs)."""
        metrics = self.metrics()
        if "eval/lossless_frac" not in metrics:
            return None
        return lossless_line(metrics)

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "metrics": self.metrics(), "results": [asdict(r) for r in self.results]}


def evaluate(
    target: FrozenTarget,
    drafter: DFlashDrafter,
    prompt_sets: list[PromptSet],
    cfg: EvalConfig,
    timing: bool,
    should_stop: Callable[[], bool] | None = None,
) -> EvalReport:
    """Every prompt set at every temperature; `should_stop` (a signal) ends it early with what
    was evaluated, `interrupted` set."""
    if next(drafter.parameters()).device != target.device:
        drafter = copy.deepcopy(drafter).to(target.device)  # gpu=split: replicas live elsewhere
    was_training = drafter.training
    drafter.eval()
    try:
        longest = max((len(p) for s in prompt_sets for p in s.prompts), default=1)
        decoders = Decoders.build(
            target,
            drafter,
            max_len=longest + cfg.max_new_tokens,
            graphs=cfg.cuda_graphs,
            compile=cfg.compile_decoding,
        )
        report = EvalReport()
        for temperature in cfg.temperatures:
            for prompt_set in prompt_sets:
                result = evaluate_set(
                    target,
                    decoders,
                    prompt_set,
                    block_size=drafter.block_size,
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=temperature,
                    seed=cfg.seed,
                    timing=timing,
                    warmup_prompts=cfg.warmup_prompts,
                    should_stop=should_stop,
                )
                if result.num_prompts:
                    report.results.append(result)
                if should_stop is not None and should_stop():
                    report.interrupted = True
                    return report
        return report
    finally:
        drafter.train(was_training)
