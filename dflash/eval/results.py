"""What an evaluation reports: per benchmark and temperature, tau, the acceptance-length
histogram, losslessness (with the logit gap at each greedy divergence) and the speedup; flat
metrics for the monitor and summary, a table for people, JSON for files."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from dflash.drafters.drafter_registry import registered_drafters
from dflash.drafters.round_tally import RoundTally


def tallied() -> Any:
    """A field a drafter's round tally may fill (`BenchmarkResult.add_figures`); None until it does."""
    return field(default=None, metadata={"tallied": True})


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
    round_cost: float | None = None  # a DFlash round's time in plain decoding steps (no prefill)
    prefill_ms: float | None = None  # the target's prefill of a prompt, the mean, timed apart
    timing_device: str | None = None
    # A drafter's per-round figures, as its `round_tally` reports them: each onto the field of
    # its name below where there is one (the built-in variants', `tallied`), the others in
    # `variant_figures`.
    # A DSpark drafter with a confidence head (dflash.drafters.dspark_tally.ConfidenceTally), per block
    # position k: the head's predicted probability that draft k is accepted, and the share of
    # rounds that accepted it; and 1 + the expected accepted drafts by each.
    confidence_by_position: list[float] | None = tallied()
    accepted_by_position: list[float] | None = tallied()
    confidence_tau: float | None = tallied()
    accepted_tau: float | None = tallied()
    # A DFlash2 drafter (dflash.drafters.pick_recorder.SelectorTally): the share of draft positions where
    # its candidate selector drafted another token than the unary argmax; of those drafts, the
    # share accepted and the share rejected where the unary token was the target's choice.
    selector_change_frac: float | None = tallied()
    selector_change_accepted_frac: float | None = tallied()
    selector_change_unary_frac: float | None = tallied()
    # Another variant's figures, by the names its round tally gives them.
    variant_figures: dict[str, Any] = field(default_factory=dict)

    def add_figures(self, figures: dict[str, Any]) -> None:
        """A drafter's round-tally fields (`RoundTally.fields`): each onto this result's `tallied`
        field of that name where it has one, else into `variant_figures`."""
        declared = {f.name: f.metadata.get("tallied", False) for f in fields(self)}
        for name, value in figures.items():
            if name not in declared:
                self.variant_figures[name] = value
            elif declared[name]:
                setattr(self, name, value)
            else:
                raise ValueError(
                    f"a drafter's round tally reports {name!r}, a figure the evaluation fills itself"
                )

    def tallied_figures(self) -> dict[str, Any]:
        """What the drafter's round tally filled: its `tallied` fields holding a value, then
        `variant_figures`. Each number among them is also a per-benchmark metric of its name."""
        filled = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.metadata.get("tallied") and getattr(self, f.name) is not None
        }
        return {**filled, **self.variant_figures}


def acceptance_figures(lengths: list[int], *, slots: int = 0) -> tuple[float, list[float]]:
    """A benchmark's tau (the mean acceptance length over every verification of its prompts,
    pooled) and acceptance histogram (the share of verifications producing k tokens, k = 0 ..
    max(slots, longest + 1) - 1, to 4 decimals), as a report gives them; tau 0 without any."""
    histogram = np.bincount(np.asarray(lengths, dtype=np.int64), minlength=slots) / max(1, len(lengths))
    return (float(np.mean(lengths)) if lengths else 0.0), [round(float(h), 4) for h in histogram]


def registered_tallies() -> list[type[RoundTally]]:
    """The registered drafters' round tallies, each once, in registration order (the built-ins
    first)."""
    tallies = (drafter.round_tally for drafter in registered_drafters().values())
    return list(dict.fromkeys(tally for tally in tallies if tally is not None))


def tallied_metric_names() -> set[str]:
    """The fields registered drafters' round tallies report as numbers (`RoundTally.reports`
    less its `per_position` lists): with `eval/<benchmark>/`, the per-benchmark metrics a sweep's
    objective may name."""
    return {
        name
        for tally in registered_tallies()
        for name in tally.reports
        if name not in getattr(tally, "per_position", ())
    }


def tally_sections(results: list[BenchmarkResult]) -> list[str]:
    """The evaluation table's sections on the drafter's round-tally fields: each registered
    tally's own (`table_lines`, on the results holding any of its `reports`), then every other
    tallied field (a tally without lines of its own, or an unregistered drafter's) as
    `name value` under "the drafter's own figures:"."""
    rows: list[str] = []
    shown: set[str] = set()
    for tally in registered_tallies():
        own_lines = getattr(tally, "table_lines", None)
        if own_lines is None:
            continue
        shown |= set(tally.reports)
        holding = [r for r in results if set(tally.reports) & r.tallied_figures().keys()]
        if holding:
            rows += ["", *own_lines(holding)]
    others = [
        (r, {name: value for name, value in r.tallied_figures().items() if name not in shown})
        for r in results
    ]
    others = [(r, figures) for r, figures in others if figures]
    if others:
        rows += ["", "the drafter's own figures:"]
        for r, figures in others:
            cells = "  ".join(f"{name} {value}" for name, value in figures.items())
            rows.append(f"  {r.benchmark} t={r.temperature:g}  {cells}")
    return rows


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

    def decodings(self) -> int:
        """Prompt decodings done, over every benchmark and temperature (fewer than planned when
        `interrupted`)."""
        return sum(result.num_prompts for result in self.results)

    def greedy(self) -> list[BenchmarkResult]:
        return [r for r in self.results if r.temperature <= 0]

    def metrics(self) -> dict[str, float]:
        """Flat floats for the monitor / summary: eval/tau and eval/lossless_frac over the
        greedy results, per-benchmark eval/<name>/tau (and each number the drafter's round tally
        reports, `tallied_figures`), the pooled acceptance histogram."""
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
            if r.round_cost is not None:
                out[f"eval/{r.benchmark}/round_cost{suffix}"] = r.round_cost
            if r.prefill_ms is not None:
                out[f"eval/{r.benchmark}/prefill_ms{suffix}"] = r.prefill_ms
            for name, value in r.tallied_figures().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[f"eval/{r.benchmark}/{name}{suffix}"] = value
        counts = sum(np.array(r.acceptance_histogram) * r.verifications for r in greedy)
        pooled = counts / max(1, sum(r.verifications for r in greedy))
        for k in range(1, len(pooled)):
            out[f"eval/accept_len_{k}_frac"] = float(pooled[k])
        return out

    def table(self) -> str:
        header = (
            f"{'benchmark':<14}{'temp':>6}{'prompts':>9}{'tau':>8}{'lossless':>10}"
            f"{'plain ms/tok':>14}{'dflash ms/tok':>15}{'speedup':>9}{'round/plain':>13}{'prefill ms':>12}"
        )
        rows = [header, "-" * len(header)]
        for r in self.results:
            lossless = "-" if r.lossless_frac is None else f"{r.lossless_frac:.0%}"
            timing = (
                f"{r.plain_ms_per_token:>14.2f}{r.dflash_ms_per_token:>15.2f}{r.speedup:>8.2f}x"
                f"{r.round_cost:>13.2f}"
                if r.speedup is not None and r.round_cost is not None
                else f"{'-':>14}{'-':>15}{'-':>9}{'-':>13}"
            )
            timing += f"{r.prefill_ms:>12.2f}" if r.prefill_ms is not None else f"{'-':>12}"
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
        rows += tally_sections(self.results)
        return "\n".join(rows)

    def lossless_line(self) -> str | None:
        """One line on the greedy check, with the reading of a failure (None without greedy runs)."""
        metrics = self.metrics()
        if "eval/lossless_frac" not in metrics:
            return None
        return lossless_line(metrics)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "metrics": self.metrics(),
            "results": [asdict(r) for r in self.results],
            "interrupted": self.interrupted,
        }
