#!/usr/bin/env python
"""The matched comparison of drafter variants as one table, the first run being the baseline.

    python scripts/variant_table.py RUN_DIR [RUN_DIR ...] [--eval-dir eval_fp32]

Per run (a `dflash-train` run dir, e.g. scripts/compare_variants.sh's WORKDIR/train_VARIANT):
the variant (its config's `variant._target_`), the steps trained, the held-out split's last
`val/tau_decode` (metrics.jsonl), and per benchmark of RUN_DIR/EVAL_DIR/eval.json (greedy rows)
tau, prompts decoded and the lossless share; each tau also as a ratio to the first run's. A
comparison is matched only where the runs trained on the same samples: the table says when the
digests of their tokenized samples (the last checkpoint's data.json) differ, and a benchmark whose prompt
counts differ between runs (an evaluation stopped early) is divided only over the prompts both
runs decoded, read from the evaluations' journals (eval.prompts.jsonl), and says how many. An
evaluation killed before writing eval.json is read from its journal alone, and the table says so.

`--positions K` adds where each run's drafts stop being accepted: per benchmark, the share of
verifications whose draft k was accepted among those whose draft k-1 was (k = 1..K, from the
report's acceptance histogram). A variant that only changes the later positions (DSpark's Markov
head conditions draft k on draft k-1) gains little while most rounds end at the first draft.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.data.identity import read_data_identity  # noqa: E402
from dflash.eval.journal import journal_path, read_outcomes  # noqa: E402
from dflash.eval.results import acceptance_figures  # noqa: E402

GREEDY = 0.0


@dataclass
class RunFigures:
    name: str
    variant: str
    steps: int | None
    data_digest: str | None
    val_tau_decode: float | None
    # benchmark -> (tau, prompts decoded, lossless share or None)
    benchmarks: dict[str, tuple[float, int, float | None]] = field(default_factory=dict)
    # benchmark -> share of verifications producing k tokens, k = 0.. (greedy rows)
    histograms: dict[str, list[float]] = field(default_factory=dict)
    # (benchmark, prompt index) -> (prompt digest, acceptance lengths): the journal's greedy outcomes
    decoded: dict[tuple[str, int], tuple[str, list[int]]] = field(default_factory=dict)
    # (benchmark, prompt index) -> whether the output equalled plain greedy output (None: not checked)
    identical: dict[tuple[str, int], bool | None] = field(default_factory=dict)
    interrupted: bool = False
    from_journal: bool = False  # no eval.json (the evaluation was killed): figures from its journal


def _metric_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _variant(run: Path) -> str:
    path = run / "config_resolved.yaml"
    if not path.is_file():
        return "?"
    target = (yaml.safe_load(path.read_text()).get("variant") or {}).get("_target_", "?")
    return target.rsplit(".", 1)[-1]


def read_run(run: Path, eval_dir: str) -> RunFigures:
    rows = _metric_rows(run)
    steps = max((int(r["step"]) for r in rows if "step" in r), default=None)
    val = [r["val/tau_decode"] for r in rows if "val/tau_decode" in r]
    summary_path = run / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    data = read_data_identity(run / "checkpoints" / "last") or {}
    figures = RunFigures(
        name=run.name,
        variant=_variant(run),
        steps=summary.get("steps", steps),
        data_digest=data.get("samples_sha256", "")[:16] or None,
        val_tau_decode=val[-1] if val else None,
    )
    report_path = run / eval_dir / "eval.json"
    if journal_path(report_path).is_file():
        for (benchmark, temperature, index), (digest, outcome) in read_outcomes(
            journal_path(report_path)
        ).items():
            if temperature == GREEDY:
                figures.decoded[benchmark, index] = (digest, outcome.result.acceptance_lengths)
                figures.identical[benchmark, index] = outcome.identical
    if not report_path.is_file() and figures.decoded:
        _figures_from_journal(figures)
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        figures.interrupted = bool(report.get("interrupted"))
        for result in report["results"]:
            if result["temperature"] == GREEDY:
                figures.benchmarks[result["benchmark"]] = (
                    result["tau"],
                    result["num_prompts"],
                    result.get("lossless_frac"),
                )
                figures.histograms[result["benchmark"]] = result["acceptance_histogram"]
    return figures


def _figures_from_journal(figures: RunFigures) -> None:
    """A killed evaluation wrote no report: each benchmark's figures from the greedy outcomes its
    journal kept, by the report's own rules (tau and histogram: dflash.eval.results's
    acceptance_figures; lossless: the share of decoded prompts found identical)."""
    figures.from_journal = True
    for benchmark in dict.fromkeys(b for b, _ in figures.decoded):
        keys = [key for key in figures.decoded if key[0] == benchmark]
        tau, histogram = acceptance_figures([length for key in keys for length in figures.decoded[key][1]])
        lossless = sum(bool(figures.identical[key]) for key in keys) / len(keys)
        figures.benchmarks[benchmark] = (tau, len(keys), lossless)
        figures.histograms[benchmark] = histogram


def _ratio(value: float | None, base: float | None) -> str:
    return "" if value is None or not base else f" ({value / base:.3f}x)"


def _ratio_on_shared_prompts(run: RunFigures, base: RunFigures, benchmark: str) -> str:
    """The ratio over the prompts both runs decoded (the same index and tokens), or why none."""
    shared = [
        key
        for key, (digest, _) in run.decoded.items()
        if key[0] == benchmark and base.decoded.get(key, ("",))[0] == digest
    ]
    if not shared:
        return " (other prompt count, none decoded by both: no ratio)"
    tau, base_tau = (
        acceptance_figures([length for key in shared for length in figures.decoded[key][1]])[0]
        for figures in (run, base)
    )
    return f" ({tau / base_tau:.3f}x on the {len(shared)} prompts both decoded: {tau:.3f} vs {base_tau:.3f})"


def table(runs: list[RunFigures]) -> str:
    base = runs[0]
    names = list(dict.fromkeys(b for run in runs for b in run.benchmarks))
    header = (
        ["run", "variant", "steps", "held-out val/tau_decode"] + [f"{b} tau" for b in names] + ["lossless"]
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        cells = [run.name, run.variant, "-" if run.steps is None else str(run.steps)]
        val = run.val_tau_decode
        cells.append(
            "-"
            if val is None
            else f"{val:.3f}" + _ratio(val, base.val_tau_decode if run is not base else None)
        )
        for name in names:
            if name not in run.benchmarks:
                cells.append("-")
                continue
            tau, prompts, _ = run.benchmarks[name]
            cell = f"{tau:.3f} ({prompts} prompts)"
            if run is not base and name in base.benchmarks:
                base_tau, base_prompts, _ = base.benchmarks[name]
                cell += (
                    _ratio(tau, base_tau)
                    if prompts == base_prompts
                    else _ratio_on_shared_prompts(run, base, name)
                )
            cells.append(cell)
        shares = [lossless for _, _, lossless in run.benchmarks.values() if lossless is not None]
        cells.append(f"{min(shares):.0%}" if shares else "-")
        lines.append("| " + " | ".join(cells) + " |")
    known = [run for run in runs if run.data_digest is not None]
    notes = [
        f"{run.name}: no checkpoint data.json, its samples are not compared"
        for run in runs
        if run not in known
    ]
    digests = {run.data_digest for run in known}
    if len(digests) > 1:
        listing = ", ".join(f"{run.name} {run.data_digest}" for run in known)
        notes.append(f"NOT matched: the runs trained on different samples ({listing})")
    elif digests:
        notes.append(f"data: every run trained on the same samples (sha256 {digests.pop()}...)")
    notes += [
        f"{run.name}: its evaluation was interrupted (the prompts decoded so far)"
        for run in runs
        if run.interrupted
    ]
    notes += [
        f"{run.name}: no eval.json (its evaluation was killed): figures from the prompts its journal kept"
        for run in runs
        if run.from_journal
    ]
    return "\n".join(lines + notes)


def conditional_acceptance(histogram: list[float], positions: int) -> list[float | None]:
    """P(draft k accepted | draft k-1 accepted), k = 1..positions: a verification producing n
    tokens accepted drafts 1..n-1 (None where no verification reached draft k-1)."""
    reached = [sum(histogram[n:]) for n in range(positions + 2)]  # produced >= n tokens
    return [reached[k + 1] / reached[k] if reached[k] > 0 else None for k in range(1, positions + 1)]


def positions_table(runs: list[RunFigures], positions: int) -> str:
    header = ["run", "benchmark"] + [f"draft {k}" for k in range(1, positions + 1)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        for benchmark, histogram in run.histograms.items():
            shares = conditional_acceptance(histogram, positions)
            cells = ["-" if share is None else f"{share:.3f}" for share in shares]
            lines.append("| " + " | ".join([run.name, benchmark, *cells]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument(
        "--eval-dir", default="eval_fp32", help="the evaluation's directory inside each run dir"
    )
    parser.add_argument(
        "--positions",
        type=int,
        default=0,
        metavar="K",
        help="also tabulate draft k's acceptance given draft k-1's, k = 1..K",
    )
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not run.is_dir()]
    if missing:
        print(f"variant_table: no such run dir: {', '.join(missing)}", file=sys.stderr)
        raise SystemExit(2)
    runs = [read_run(run, args.eval_dir) for run in args.runs]
    print(table(runs))
    if args.positions:
        print("\ndraft k accepted, of the verifications whose draft k-1 was (greedy):")
        print(positions_table(runs, args.positions))


if __name__ == "__main__":
    main()
