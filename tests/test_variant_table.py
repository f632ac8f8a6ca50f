"""scripts/variant_table.py: the matched comparison's table, read from finished run dirs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.scripts_as_modules import load_script

variant_table = load_script("variant_table")


def write_run(
    root: Path,
    name: str,
    *,
    variant: str,
    val_taus: list[float],
    benchmarks: dict[str, tuple[float, int, float]],
    samples_sha256: str = "ab" * 32,
    steps: int = 800,
    histogram: tuple[float, ...] = (0.0, 1.0),
) -> Path:
    run = root / name
    (run / "checkpoints" / "last").mkdir(parents=True)
    (run / "config_resolved.yaml").write_text(f"variant:\n  _target_: dflash.step.variant.{variant}\n")
    rows = [{"step": 100 * (i + 1), "val/tau_decode": tau} for i, tau in enumerate(val_taus)]
    rows.append({"step": steps, "train/loss": 1.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"steps": steps}))
    (run / "checkpoints" / "last" / "data.json").write_text(json.dumps({"samples_sha256": samples_sha256}))
    results = [
        {
            "benchmark": b,
            "temperature": 0.0,
            "tau": tau,
            "num_prompts": n,
            "lossless_frac": lossless,
            "acceptance_histogram": list(histogram),
        }
        for b, (tau, n, lossless) in benchmarks.items()
    ]
    # A sampled row of the same benchmark: not a greedy figure, so not in the table.
    results.append(
        {
            "benchmark": "humaneval",
            "temperature": 1.0,
            "tau": 9.0,
            "num_prompts": 80,
            "lossless_frac": None,
            "acceptance_histogram": [0.0, 0.0, 1.0],
        }
    )
    (run / "eval_fp32").mkdir()
    (run / "eval_fp32" / "eval.json").write_text(json.dumps({"results": results, "interrupted": False}))
    return run


def table_of(*runs: Path) -> str:
    return variant_table.table([variant_table.read_run(run, "eval_fp32") for run in runs])


def test_each_variants_taus_are_divided_by_the_first_runs_on_the_same_benchmark(tmp_path):
    runs = [
        write_run(tmp_path, name, variant=variant, val_taus=val_taus, benchmarks=benchmarks)
        for name, variant, val_taus, benchmarks in (
            ("train_dflash", "DFlashVariant", [1.2, 1.5], {"humaneval": (1.5, 80, 1.0), "mtbench": (1.4, 80, 1.0)}),
            ("train_dflash2", "DFlash2Variant", [1.3, 1.65], {"humaneval": (1.65, 80, 1.0), "mtbench": (1.47, 80, 0.95)}),
        )
    ]  # fmt: skip
    text = table_of(*runs)
    lines = text.splitlines()
    assert (
        lines[0]
        == "| run | variant | steps | held-out val/tau_decode | humaneval tau | mtbench tau | lossless |"
    )
    assert (
        lines[2]
        == "| train_dflash | DFlashVariant | 800 | 1.500 | 1.500 (80 prompts) | 1.400 (80 prompts) | 100% |"
    )
    # The last held-out figure, the greedy rows only, and the smallest lossless share.
    assert lines[3] == (
        "| train_dflash2 | DFlash2Variant | 800 | 1.650 (1.100x) | 1.650 (80 prompts) (1.100x) "
        "| 1.470 (80 prompts) (1.050x) | 95% |"
    )
    assert "every run trained on the same samples (sha256 abababababababab...)" in text


def test_runs_on_other_samples_or_other_prompt_counts_are_not_read_as_matched(tmp_path):
    base = write_run(
        tmp_path, "a", variant="DFlashVariant", val_taus=[1.4], benchmarks={"humaneval": (1.5, 80, 1.0)}
    )
    other = write_run(
        tmp_path,
        "b",
        variant="DSparkVariant",
        val_taus=[1.4],
        benchmarks={"humaneval": (1.6, 47, 1.0)},
        samples_sha256="cd" * 32,
    )
    text = table_of(base, other)
    assert "1.600 (47 prompts) (other prompt count, none decoded by both: no ratio)" in text
    assert (
        "NOT matched: the runs trained on different samples (a abababababababab, b cdcdcdcdcdcdcdcd)" in text
    )


def write_journal(run: Path, outcomes: dict[tuple[str, float, int], tuple[list[int], list[int]]]) -> None:
    """The evaluation's journal as dflash-eval writes it: (benchmark, temperature, index) ->
    (prompt tokens, acceptance lengths)."""
    from dflash.decoding.reference import DecodeResult
    from dflash.eval.journal import EvalJournal, PromptOutcome

    journal = EvalJournal(run / "eval_fp32" / "eval.prompts.jsonl", {"dtype": "float32"}, resume=False)
    for (benchmark, temperature, index), (prompt, lengths) in outcomes.items():
        result = DecodeResult(output_ids=[7] * sum(lengths), acceptance_lengths=lengths)
        journal.record(benchmark, temperature, index, prompt, PromptOutcome(result, identical=True))
    journal.close()


def test_an_evaluation_stopped_early_is_compared_on_the_prompts_both_runs_decoded(tmp_path):
    """The baseline decoded 3 prompts, the other run 2 of them, a 3rd under other tokens (its prompt
    file changed) and a sampled one: the ratio pools the 2 shared greedy prompts' verifications."""
    base = write_run(
        tmp_path, "a", variant="DFlashVariant", val_taus=[1.4], benchmarks={"mtbench": (1.5, 3, 1.0)}
    )
    other = write_run(
        tmp_path, "b", variant="DSparkVariant", val_taus=[1.4], benchmarks={"mtbench": (2.0, 4, 1.0)}
    )
    write_journal(base, {("mtbench", 0.0, 0): ([1, 2], [1, 2]), ("mtbench", 0.0, 1): ([3], [1, 1, 1, 1]), ("mtbench", 0.0, 2): ([4], [3])})  # fmt: skip
    write_journal(other, {("mtbench", 0.0, 0): ([1, 2], [2, 2]), ("mtbench", 0.0, 1): ([3], [2, 2, 2]), ("mtbench", 0.0, 2): ([5], [9]), ("mtbench", 1.0, 0): ([1, 2], [9])})  # fmt: skip
    # shared: prompts 0 and 1; b pools [2, 2, 2, 2, 2] -> 2.0, a pools [1, 2, 1, 1, 1, 1] -> 7/6
    assert "2.000 (4 prompts) (1.714x on the 2 prompts both decoded: 2.000 vs 1.167)" in table_of(base, other)


def test_an_evaluation_killed_before_its_report_is_read_from_its_journal(tmp_path, capsys):
    """No eval.json, only the journal's greedy outcomes (a sampled one left out): tau pools the
    verifications, the prompt count is what was decoded, lossless is the identical share, the
    ratio divides over the prompts both runs decoded, and the positions come from the lengths."""
    base = write_run(
        tmp_path, "a", variant="DFlashVariant", val_taus=[1.4], benchmarks={"mtbench": (1.5, 3, 1.0)}
    )
    write_journal(base, {("mtbench", 0.0, 0): ([1, 2], [1, 2]), ("mtbench", 0.0, 1): ([3], [1, 1, 1, 1]), ("mtbench", 0.0, 2): ([4], [3])})  # fmt: skip
    killed = write_run(tmp_path, "b", variant="DFlash2Variant", val_taus=[1.5], benchmarks={})
    (killed / "eval_fp32" / "eval.json").unlink()
    write_journal(killed, {("mtbench", 0.0, 0): ([1, 2], [2, 2]), ("mtbench", 0.0, 1): ([3], [2, 1, 3]), ("mtbench", 1.0, 0): ([1, 2], [9])})  # fmt: skip
    text = table_of(base, killed)
    # b pools [2, 2, 2, 1, 3] -> 2.0 over 2 prompts; a on those prompts pools [1, 2, 1, 1, 1, 1] -> 7/6
    assert (
        "| b | DFlash2Variant | 800 | 1.500 (1.071x) | 2.000 (2 prompts) (1.714x on the 2 prompts both decoded: 2.000 vs 1.167) | 100% |"
        in text
    )
    assert "b: no eval.json (its evaluation was killed): figures from the prompts its journal kept" in text
    run = variant_table.read_run(killed, "eval_fp32")
    assert run.histograms["mtbench"] == [0.0, 0.2, 0.6, 0.2]
    assert variant_table.conditional_acceptance(run.histograms["mtbench"], 2) == [0.8, 0.25]


def test_a_run_not_yet_evaluated_shows_dashes_and_a_missing_dir_exits_2(tmp_path, capsys):
    base = write_run(
        tmp_path, "a", variant="DFlashVariant", val_taus=[1.4], benchmarks={"humaneval": (1.5, 80, 1.0)}
    )
    unevaluated = tmp_path / "b"
    unevaluated.mkdir()
    (unevaluated / "metrics.jsonl").write_text(json.dumps({"step": 380, "train/loss": 2.0}) + "\n")
    text = table_of(base, unevaluated)
    assert text.splitlines()[3] == "| b | ? | 380 | - | - | - |"
    assert "b: no checkpoint data.json, its samples are not compared" in text
    assert "NOT matched" not in text
    with pytest.raises(SystemExit) as exit_info:
        variant_table.main([str(base), str(tmp_path / "missing")])
    assert exit_info.value.code == 2
    assert "no such run dir" in capsys.readouterr().err


def test_positions_give_each_drafts_acceptance_given_the_one_before(tmp_path, capsys):
    """Half the verifications produce 1 token (draft 1 rejected), a quarter 2, a quarter 3: draft 1
    accepted in 0.5 of them, draft 2 in 0.5 of those, draft 3 in none, draft 4 never reached."""
    assert variant_table.conditional_acceptance([0.0, 0.5, 0.25, 0.25], 4) == [0.5, 0.5, 0.0, None]
    run = write_run(tmp_path, "a", variant="DFlashVariant", val_taus=[1.4], benchmarks={"humaneval": (1.75, 80, 1.0)}, histogram=(0.0, 0.5, 0.25, 0.25))  # fmt: skip
    variant_table.main([str(run), "--positions", "4"])
    assert "| a | humaneval | 0.500 | 0.500 | 0.000 | - |" in capsys.readouterr().out
