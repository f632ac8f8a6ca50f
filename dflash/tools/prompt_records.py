"""The asks of `dflash prompts` as conversations: each ask wrapped as a one-turn record whose reply
dflash regen writes, a share of them continued into a second turn, records compared with the
evaluation benchmarks by 13-word windows (benchmarks never enter training data) and with an
earlier file's opening asks, and the kept records mixed by each source's share."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np

from dflash.data.benchmarks import PACKAGED, packaged_prompts
from dflash.data.conversations import MalformedRecord, normalize

PLACEHOLDER = "(the target writes this reply: run dflash regen on this file)"


WINDOW = 13  # words: the contamination check's window


# Code about half: with 36% standard-library prompts (9K of 25K) the SmolLM2 drafter's HumanEval
# tau fell from 2.70 to 2.36 while MT-Bench rose from 1.58 to 2.19 against a mostly code and
# documentation set of the same size (benchmarks/RESULTS.md, 2026-11-30 evening and night). The
# shares are about those of the 50,000-conversation set of RESULTS.md 2026-12-01: 40,000 from the
# first seven sources, then 10,000 more of the last two (3,659 function completions, nearly all
# there are, and 6,341 two-turn chats; written with --sources and --exclude).
SHARES = {
    "python stdlib": 0.36,
    "debian readmes": 0.03,
    "readme extraction": 0.015,
    "fastchat dummy conversations": 0.015,
    "wordnet senses": 0.24,
    "fortunes": 0.065,
    "math and reasoning": 0.07,
    "function completions": 0.075,
    "two-turn chats": 0.13,
}


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def windows(text: str) -> set[tuple[str, ...]]:
    tokens = words(text)
    return {tuple(tokens[i : i + WINDOW]) for i in range(max(0, len(tokens) - WINDOW + 1))}


def benchmark_windows() -> set[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()
    for name in PACKAGED:
        try:
            path, _ = packaged_prompts(f"benchmark {name}", f"package:{name}")
        except ValueError as exc:
            raise SystemExit(f"the contamination check needs every benchmark installed: {exc}") from exc
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                for text in [record.get("prompt", "")] + list(record.get("turns", [])):
                    found |= windows(text)
    return found


def record_text(record: dict) -> str:
    """Every turn's text, read as dflash regen reads a record (either shape)."""
    messages, _ = normalize(record, need_reply=False)
    return "\n".join(m["content"] for m in messages)


def asks(prompts: list[str]) -> list[dict]:
    """Each prompt as a one-turn conversation whose reply dflash regen writes."""
    return [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": PLACEHOLDER}]}
        for p in prompts
    ]


# Second turns by the source of the first (our own words): MT-Bench's conversations have two
# turns, the second asking to rework the first reply, and a drafter trained on one-turn
# conversations only has never seen a reply that builds on an earlier one of its target.
FOLLOW_UPS = {
    "python stdlib": (
        "Now add type hints and a short docstring to the code.",
        "What is the time complexity of this, and could it be made faster?",
        "Write three pytest test cases for it, including one edge case.",
        "Explain the same thing to someone who has never programmed.",
    ),
    "wordnet senses": (
        "Now rewrite your answer in about half as many words, keeping the main point.",
        "Rewrite your answer for a reader who is an expert on the subject.",
        "Give your answer a title, and add a closing paragraph that asks the reader a question.",
        "Turn your answer into a numbered list of its main points.",
        "Rewrite your answer so that no sentence is longer than twelve words.",
        "Which part of your answer are you least sure about, and why?",
    ),
    "fortunes": (
        "Now write a saying that claims the opposite, and argue for it in a few sentences.",
        "Retell it as a poem of four lines.",
        "Who might have said this, and in what situation? Describe the scene briefly.",
    ),
    "math and reasoning": (
        "Check your answer by a different method.",
        "Now change one of the numbers in the problem, and solve the new problem.",
        "Explain the solution to a ten-year-old in three sentences.",
        "What mistake would a student most likely make on this problem?",
    ),
    "readme extraction": (
        "Now put the same information in a Markdown table.",
        "Write the result as YAML instead of JSON.",
        "Which of these would a new user need first? Answer in two sentences.",
    ),
}


TWO_TURN_FRACTION = 0.3  # of each FOLLOW_UPS source's first turns


def two_turn_chats(sources: dict[str, list[dict]], rng: np.random.Generator) -> list[dict]:
    """Moves a seeded TWO_TURN_FRACTION of each FOLLOW_UPS source's one-turn asks into two-turn
    conversations (the ask, a reply, a follow-up, a reply), so no first turn is in both. An ask
    drawn twice (the math generator repeats some) opens one chat, whatever its follow-ups."""
    chats, opened = [], set()
    for source, follow_ups in FOLLOW_UPS.items():
        records = sources[source]
        moved = rng.random(len(records)) < TWO_TURN_FRACTION
        sources[source] = [r for r, m in zip(records, moved, strict=True) if not m]
        for record in (r for r, m in zip(records, moved, strict=True) if m):
            ask = opening_ask(record)
            if ask in opened:
                continue
            opened.add(ask)
            follow_up = follow_ups[rng.integers(len(follow_ups))]
            chats.append(
                {
                    "messages": record["messages"]
                    + [{"role": "user", "content": follow_up}, {"role": "assistant", "content": PLACEHOLDER}]
                }
            )
    return chats


def opening_ask(record: dict) -> str:
    """The first user turn's text ("" when there is none), read as dflash regen reads a record."""
    messages, _ = normalize(record, need_reply=False)
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def opening_asks(paths: list[Path]) -> set[str]:
    """The opening asks of the conversations in `paths` (earlier prompts files)."""
    found: set[str] = set()
    for path in paths:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                try:
                    found.add(opening_ask(json.loads(line)))
                except (json.JSONDecodeError, MalformedRecord) as exc:
                    raise SystemExit(f"--exclude {path}:{number}: not a conversation ({exc})") from exc
    return found


def mix(kept: dict[str, list[dict]], limit: int | None, rng: np.random.Generator) -> list[dict]:
    """Every kept record in a seeded order; with `limit`, each source's SHARES of it first (shares
    of the sources present), then the other sources' records fill what a small source could not."""
    shuffled = {
        source: [records[i] for i in rng.permutation(len(records))] for source, records in kept.items()
    }
    if limit is None:
        chosen = [record for records in shuffled.values() for record in records]
    else:
        chosen, spare = [], []
        total_share = sum(SHARES[source] for source in shuffled)  # < 1 with --sources
        for source, records in shuffled.items():
            quota = round(SHARES[source] / total_share * limit)
            chosen += records[:quota]
            spare += records[quota:]
        chosen += [spare[i] for i in rng.permutation(len(spare))][: max(0, limit - len(chosen))]
        chosen = chosen[:limit]
    return [chosen[i] for i in rng.permutation(len(chosen))]
