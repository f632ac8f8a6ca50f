"""Conversation files -> tokenized training samples, cached.

The cache file is keyed by everything that changes the tokens: the tokenizer (vocabulary,
merges, special tokens), the chat template, `data.max_length`, `data.min_supervised_tokens`
and the bytes of every source file (content hashes, so editing a file in place invalidates it
and copying it elsewhere does not). A second run with the same inputs loads the cache and
starts at once. The key is explicit rather than datasets' fingerprint of a pickled function:
a cache that silently survives a tokenizer change is the bug this prevents.

Tokenization runs in this process, or through `datasets.Dataset.map` over `data.num_proc`
processes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash.config.schema import DataConfig
from dflash.data.chat import ChatRenderer
from dflash.data.conversations import (
    AUTO_LAYOUT,
    Conversation,
    MalformedRecord,
    SkipReport,
    chunked,
    conversation_digest,
    expand_files,
    read_conversations,
    record_layout,
)
from dflash.data.dataset import TokenDataset
from dflash.data.files import source_digest

log = logging.getLogger(__name__)

# Bump when the rendering or masking rules change: old caches then stop matching.
FORMAT_VERSION = 2  # 2: reply spans from the template's own rendering (dflash/data/chat.py)
# Conversations tokenized per round (one datasets.map call when data.num_proc > 1).
CHUNK = 20_000
# Skip reasons counted while reading (the record never became a conversation).
READ_PROBLEMS = ("invalid_json", "invalid_utf8", "malformed")


@dataclass
class PrepStats:
    records: int = 0  # records read, well-formed or not
    samples: int = 0  # training samples written
    truncated: int = 0  # samples cut to data.max_length
    tokens: int = 0
    supervised_tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # by reason
    skipped_examples: list[str] = field(default_factory=list)  # "file:line: why", the first few
    cache_path: str = ""
    reused_cache: bool = False
    files: list[str] = field(default_factory=list)  # as named when the cache was written
    duplicates: int = 0  # conversations repeating an earlier one (kept)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        out = [
            f"records read         {self.records}",
            f"training samples     {self.samples} ({self.truncated} truncated to data.max_length)",
            f"tokens               {self.tokens} ({self.supervised_tokens} supervised)",
            f"skipped              {sum(self.skipped.values())} "
            + (" ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or ""),
        ]
        out += [f"  {example}" for example in self.skipped_examples]
        if self.duplicates:
            out.append(f"duplicates           {self.duplicates} conversations repeat an earlier one (kept)")
        out.append(f"cache                {self.cache_path} ({'reused' if self.reused_cache else 'written'})")
        return out


def cache_key(renderer: ChatRenderer, cfg: DataConfig) -> str:
    payload = {
        "format": FORMAT_VERSION,
        "tokenizer": renderer.fingerprint(),
        "max_length": cfg.max_length,
        "min_supervised_tokens": cfg.min_supervised_tokens,
        "files": [source_digest(path) for path in expand_files(list(cfg.files), "data.files")],
    }
    layout = record_layout(cfg.layout)
    if layout != AUTO_LAYOUT:  # it changes which turns are read; the auto layout keeps the keys caches had
        payload["layout"] = asdict(layout)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _tokenize_batch(batch: dict[str, list[Any]], renderer: ChatRenderer, max_length: int) -> dict[str, list]:
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "problem": [], "full_length": []}
    for messages in batch["messages"]:
        try:
            ids, mask = renderer.tokenize(messages)
            problem = ""
        except MalformedRecord as exc:
            ids, mask, problem = [], [], str(exc)
        out["full_length"].append(len(ids))
        out["input_ids"].append(ids[:max_length])
        out["loss_mask"].append(mask[:max_length])
        out["problem"].append(problem)
    return out


def _tokenize_all(conversations: list, renderer: ChatRenderer, cfg: DataConfig) -> list[dict[str, Any]]:
    """One row per conversation; across `data.num_proc` processes with datasets.map when > 1."""
    columns = {"source": [c.source for c in conversations], "messages": [c.messages for c in conversations]}
    if (cfg.num_proc or 1) > 1:
        import datasets

        return list(
            datasets.Dataset.from_dict(columns).map(
                _tokenize_batch,
                batched=True,
                batch_size=256,
                num_proc=cfg.num_proc,
                fn_kwargs={"renderer": renderer, "max_length": cfg.max_length},
                remove_columns=["messages"],
                desc="dflash prep: tokenizing",
            )
        )
    out = _tokenize_batch(columns, renderer, cfg.max_length)
    return [
        {"source": source, **{k: v[i] for k, v in out.items()}} for i, source in enumerate(columns["source"])
    ]


def count_repeats(conversations: Iterator[Conversation], stats: PrepStats) -> Iterator[Conversation]:
    """Every conversation, the repeats of earlier ones counted (kept: data that repeats a
    conversation on purpose weighs it so; an accidental repeat shows in the count)."""
    seen: set[str] = set()
    for conversation in conversations:
        digest = conversation_digest(conversation)
        stats.duplicates += digest in seen
        seen.add(digest)
        yield conversation


def prepare(renderer: ChatRenderer, cfg: DataConfig) -> tuple[TokenDataset, PrepStats]:
    """Streams the files `CHUNK` conversations at a time; each kept sample is held as two compact
    arrays (int32 ids, uint8 mask), so memory follows the token count, not the text."""
    stats, skipped = (
        PrepStats(files=[str(p) for p in expand_files(list(cfg.files), "data.files")]),
        SkipReport(),
    )
    conversations = count_repeats(
        read_conversations(list(cfg.files), skipped, "data.files", record_layout(cfg.layout)), stats
    )
    samples: list[tuple[np.ndarray, np.ndarray]] = []
    read = 0
    for chunk in chunked(conversations, CHUNK):
        read += len(chunk)
        for row in _tokenize_all(chunk, renderer, cfg):
            if row["problem"]:
                skipped.add("template", row["source"], row["problem"])
                continue
            supervised = sum(row["loss_mask"])
            if supervised < cfg.min_supervised_tokens:
                skipped.add(
                    "too_few_supervised",
                    row["source"],
                    f"{supervised} supervised tokens < data.min_supervised_tokens={cfg.min_supervised_tokens}",
                )
                continue
            stats.truncated += row["full_length"] > cfg.max_length
            stats.tokens += len(row["input_ids"])
            stats.supervised_tokens += supervised
            samples.append((np.asarray(row["input_ids"], np.int32), np.asarray(row["loss_mask"], np.uint8)))
    stats.records = read + sum(v for k, v in skipped.counts.items() if k in READ_PROBLEMS)
    stats.samples = len(samples)
    stats.skipped, stats.skipped_examples = dict(skipped.counts), list(skipped.examples)
    if not samples and not stats.records:
        raise ValueError(
            f"data.files={list(cfg.files)}: the files hold no conversation records (empty?); "
            "each line (or array item) must be an OpenAI `messages` or ShareGPT `conversations` record"
        )
    if not samples:
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(stats.skipped.items()))
        raise ValueError(
            f"data.files={list(cfg.files)}: none of {stats.records} records is usable ({reasons}); "
            f"first problems: {'; '.join(stats.skipped_examples)}"
        )
    return TokenDataset.from_samples(samples), stats


def renamed(stats: PrepStats, files: list[str]) -> None:
    """A cache reused for the same bytes under other names: its skip examples name this run's
    files (the cache key lists the files' digests in order, so file i is file i)."""
    if len(stats.files) != len(files):
        return
    for old, new in zip(stats.files, files):
        if old != new:
            stats.skipped_examples = [
                new + example[len(old) :] if example.startswith(old + ":") else example
                for example in stats.skipped_examples
            ]
    stats.files = files


def load_or_prepare(
    renderer: ChatRenderer, cfg: DataConfig, cache_dir: Path
) -> tuple[TokenDataset, PrepStats]:
    started = time.perf_counter()
    path = Path(cache_dir) / "conversations" / f"{cfg.name}-{cache_key(renderer, cfg)}.safetensors"
    stats_path = path.with_suffix(".json")
    if path.exists() and stats_path.exists():
        stats = PrepStats(**json.loads(stats_path.read_text()))
        stats.reused_cache, stats.seconds = True, round(time.perf_counter() - started, 2)
        renamed(stats, [str(p) for p in expand_files(list(cfg.files), "data.files")])
        log.info("data: reusing %s", path)
        return TokenDataset.load(path), stats
    dataset, stats = prepare(renderer, cfg)
    stats.cache_path = str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset.save(path)
    stats_path.write_text(json.dumps(asdict(stats), indent=2) + "\n")
    stats.seconds = round(time.perf_counter() - started, 2)
    if stats.skipped:
        log.warning(
            "data: skipped %d of %d records %s; first: %s",
            sum(stats.skipped.values()),
            stats.records,
            stats.skipped,
            stats.skipped_examples,
        )
    return dataset, stats
