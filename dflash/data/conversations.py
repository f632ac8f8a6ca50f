"""Conversation files in, normalized messages out, with every bad record counted and located.

Accepted shapes, per record (auto-detected):
  OpenAI:   {"messages": [{"role": "user", "content": "..."}, ...]}
  ShareGPT: {"conversations": [{"from": "human", "value": "..."}, ...]}
Content may also be a list of OpenAI content parts ({"type": "text", "text": ...}). Records whose
turns sit under other names (a `chat` column of {"speaker", "text"} turns) are read with a
`RecordLayout` naming them (`data.layout` / regen's `layout`).

Files (dflash/data/files.py): `.jsonl` (JSON Lines), `.json` (JSON Lines, or one top-level
array as ShareGPT dumps often are), both also `.gz` / `.zst`, and `.parquet` (read with
`datasets`), any case, and directories `datasets`' save_to_disk wrote (a Dataset, or every split of
a DatasetDict); entries may be glob patterns or directories (read recursively). JSON
Lines are parsed line by line on purpose: a loader that parses whole blocks (datasets' json
builder) stops at the first broken line, and a 800k-conversation run must skip that line, count
it and say where it was. A line that is not UTF-8 is skipped and counted the same way (decoding
it with replacement characters would train on them).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.data.files import RecordFile, files_under, is_saved_dataset, lines, open_binary, record_file

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}
# How many malformed records are quoted with their location (all are counted).
QUOTED_PROBLEMS = 5


@dataclass(frozen=True)
class RecordLayout:
    """Where a record keeps its turns: `field` (the column), and each turn's `role` and `content`
    keys. None: auto (`messages` with role/content, else `conversations` with from/value; with
    only `field` named, a turn's keys are role/content if it has `role`, else from/value)."""

    field: str | None = None
    role: str | None = None
    content: str | None = None


AUTO_LAYOUT = RecordLayout()


def record_layout(config: Any) -> RecordLayout:
    """The layout a `ConversationLayoutConfig` node names."""
    return RecordLayout(field=config.field, role=config.role, content=config.content)


class MalformedRecord(ValueError):
    """A record that cannot become a training sample; the message says why."""


@dataclass
class Conversation:
    source: str  # "file:line" (or "file:row N" for Parquet), for error messages
    messages: list[dict[str, str]]  # role in {system, user, assistant}, content str
    extra: dict[str, Any] = field(default_factory=dict)  # other fields of the record, kept by regen


@dataclass
class SkipReport:
    """Records skipped, by reason, with the location of the first few."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str, source: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples) < QUOTED_PROBLEMS:
            self.examples.append(f"{source}: {detail}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def conversation_digest(conversation: Conversation) -> str:
    """A conversation's identity: its messages, not where they were read from (regen's resume
    key; training data counts a repeat of one)."""
    text = json.dumps(conversation.messages, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def drop_repeats(conversations: Iterator[Conversation], skipped: SkipReport) -> Iterator[Conversation]:
    """Each conversation once: a repeat of an earlier one (the same messages: a file given twice,
    a shard overlap) is counted as a duplicate and left out."""
    seen: set[str] = set()
    for conversation in conversations:
        digest = conversation_digest(conversation)
        if digest in seen:
            skipped.add("duplicate", conversation.source, "the same conversation as an earlier record")
            continue
        seen.add(digest)
        yield conversation


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise MalformedRecord(f"{where}: content must be a string (or text parts), got {type(value).__name__}")


def _turn_keys(turns: Any, layout: RecordLayout, field_name: str) -> tuple[str, str]:
    """(role key, content key) of a record's turns: the layout's, else the shape's."""
    if field_name == "messages" and layout.field is None:
        role, content = "role", "content"
    elif field_name == "conversations" and layout.field is None:
        role, content = "from", "value"
    else:  # a named field: its turns tell which shape they are
        first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
        role, content = ("role", "content") if "role" in first else ("from", "value")
    return layout.role or role, layout.content or content


def normalize(
    record: Any, need_reply: bool = True, layout: RecordLayout = AUTO_LAYOUT
) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """(messages, other fields) of one record in either shape (or the layout's); MalformedRecord
    otherwise."""
    if not isinstance(record, dict):
        raise MalformedRecord(f"a record must be a JSON object, got {type(record).__name__}")
    if layout.field is not None:
        if layout.field not in record:
            raise MalformedRecord(
                f"no {layout.field!r} field (the layout's; the record has {sorted(record)})"
            )
        field_name = layout.field
    elif "messages" in record:
        field_name = "messages"
    elif "conversations" in record:
        field_name = "conversations"
    else:
        raise MalformedRecord(
            f"no 'messages' (OpenAI) or 'conversations' (ShareGPT) field (the record has {sorted(record)}; "
            "name its turns' field with layout.field)"
        )
    turns = record[field_name]
    role_key, content_key = _turn_keys(turns, layout, field_name)
    if not isinstance(turns, list) or not turns:
        raise MalformedRecord(f"'{field_name}' must be a non-empty list")
    messages = []
    for index, turn in enumerate(turns):
        where = f"{field_name}[{index}]"
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise MalformedRecord(f"{where} needs '{role_key}' and '{content_key}'")
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise MalformedRecord(f"{where}: unknown role {turn[role_key]!r}")
        messages.append({"role": role, "content": _content(turn[content_key], where)})
    if need_reply and not any(m["role"] == "assistant" for m in messages):
        raise MalformedRecord("no assistant turn")
    extra = {k: v for k, v in record.items() if k != field_name}
    return messages, extra


def _json_records(record: RecordFile) -> Iterator[tuple[str, Any]]:
    """(location, parsed record, or the JSONDecodeError / UnicodeDecodeError) for each record
    of a JSON file."""
    path = record.path
    if record.kind == "json":
        with open_binary(record) as handle:
            is_array = handle.read(4096).lstrip()[:1] == b"["
        if is_array:
            with open_binary(record) as handle:
                data = handle.read()
            try:
                records = json.loads(data.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield f"{path}:{getattr(exc, 'lineno', 1)}", exc
                return
            for index, item in enumerate(records):
                yield f"{path}:record {index}", item
            return
    for line_no, line in lines(record):
        try:
            yield f"{path}:{line_no}", json.loads(line.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            yield f"{path}:{line_no}", exc


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        table = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    except Exception as exc:  # pyarrow's errors (a truncated file, not Parquet) name no path
        raise ValueError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from exc
    for index, record in enumerate(table):
        yield f"{path}:row {index}", record


def _saved_dataset_records(path: Path) -> Iterator[tuple[str, Any]]:
    """The rows of a save_to_disk directory: a Dataset's, or each split's of a DatasetDict (in
    name order), located as `DIR:SPLIT row N`."""
    import datasets

    saved = datasets.load_from_disk(str(path))
    splits = sorted(saved.items()) if isinstance(saved, datasets.DatasetDict) else [(None, saved)]
    for split, table in splits:
        where = f"{path}:{split} row" if split is not None else f"{path}:row"
        for index, record in enumerate(table):
            yield f"{where} {index}", record


def is_glob(entry: str) -> bool:
    return any(ch in entry for ch in "*?[")


def entry_reads(entry: str, path: Path) -> bool:
    """Whether `expand_files([entry])` reads a file at `path`, whether or not it exists yet
    (dflash-regen refuses an output its inputs would read back). The same rules as below: a
    glob matches it, a directory holds it with a supported suffix, a file path is it (by path, or
    by inode: a link)."""
    candidates = {Path(os.path.abspath(path)), path.resolve()}
    if is_glob(entry):
        return any(fnmatch.fnmatch(str(c), os.path.abspath(entry)) for c in candidates)
    named = Path(entry)
    if named.is_dir():
        root, inside = named.resolve(), path.resolve()
        hidden = inside.is_relative_to(root) and any(
            p.startswith(".") for p in inside.relative_to(root).parts
        )
        return inside.is_relative_to(root) and not hidden and record_file(path) is not None
    return named.resolve() in candidates or (
        named.exists() and path.exists() and os.path.samefile(named, path)
    )


def expand_files(entries: list[str], config_key: str) -> list[Path]:
    """Files named by `entries`: paths, glob patterns (`shards/*.jsonl`, sorted) or directories
    (every record file under them, recursively, sorted: dflash/data/files.py). Each entry must
    name at least one file."""
    files: list[Path] = []
    for entry in entries:
        path = Path(entry)
        if is_glob(entry):
            matches = sorted(
                p for p in Path(path.anchor or ".").glob(str(path.relative_to(path.anchor or ".")))
            )
            matched = [p for p in matches if p.is_file()]
        elif is_saved_dataset(path):
            matched = [path]
        elif path.is_dir():
            matched = files_under(path)
        else:
            matched = [path]
        if not matched:
            raise ValueError(f"{config_key}: {entry!r} matches no file")
        files += matched
    return files


def chunked(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    """Lists of `size` consecutive items (the last may be shorter)."""
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def read_conversations(
    files: list[str], skipped: SkipReport, config_key: str, layout: RecordLayout = AUTO_LAYOUT
) -> Iterator[Conversation]:
    """Every well-formed conversation of `files` (see expand_files), in order; bad records go to
    `skipped`."""
    for path in expand_files(files, config_key):
        if is_saved_dataset(path):
            yield from _conversations(_saved_dataset_records(path), skipped, layout)
            continue
        if not path.is_file():
            raise ValueError(f"{config_key}: {path} is not a file")
        kind = record_file(path)
        if kind is None:
            raise ValueError(
                f"{config_key}: {path} is not a record file (.jsonl, .json or .parquet; the JSON ones "
                "also as .gz or .zst)"
            )
        records = _parquet_records(path) if kind.kind == "parquet" else _json_records(kind)
        yield from _conversations(records, skipped, layout)


def _conversations(
    records: Iterator[tuple[str, Any]], skipped: SkipReport, layout: RecordLayout
) -> Iterator[Conversation]:
    for source, record in records:
        if isinstance(record, UnicodeDecodeError):
            skipped.add("invalid_utf8", source, f"not UTF-8 ({record.reason} at byte {record.start})")
            continue
        if isinstance(record, json.JSONDecodeError):
            skipped.add("invalid_json", source, f"invalid JSON ({record.msg})")
            continue
        try:
            messages, extra = normalize(record, layout=layout)
        except MalformedRecord as exc:
            skipped.add("malformed", source, str(exc))
            continue
        yield Conversation(source, messages, extra)
