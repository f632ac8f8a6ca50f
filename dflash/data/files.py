"""Which files hold records (conversations, prompts) and how to open them, for every reader.

A record file is `.jsonl`, `.json` or `.parquet` (any case), the JSON ones also compressed as
`.gz` or `.zst`. A directory is read recursively: every record file under it, sorted by path;
hidden files and directories (a name starting with '.', e.g. a lock) are passed over, and any
other file is named in a warning with its count, never read and never silently dropped.
"""

from __future__ import annotations

import gzip
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
COMPRESSIONS = (".gz", ".zst")


@dataclass(frozen=True)
class RecordFile:
    path: Path
    kind: str  # jsonl, json or parquet
    compression: str | None  # .gz, .zst or None


def record_file(path: Path) -> RecordFile | None:
    """`path` as a record file, or None when its name is not one of the supported forms."""
    name = path.name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), None)
    base = name[: -len(compression)] if compression else name
    kind = next((suffix[1:] for suffix in RECORD_SUFFIXES if base.endswith(suffix)), None)
    if kind is None or (kind == "parquet" and compression is not None):
        return None
    return RecordFile(path, kind, compression)


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def files_under(directory: Path) -> list[Path]:
    """Every record file under `directory` (recursively, sorted); the other files are named in a
    warning with their count."""
    found, ignored = [], []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not _hidden(p, directory)):
        (found if record_file(path) is not None else ignored).append(path)
    if ignored:
        shown = ", ".join(str(p.relative_to(directory)) for p in ignored[:5])
        log.warning(
            "%s: %d file(s) not read (not %s, or their .gz / .zst forms): %s%s",
            directory,
            len(ignored),
            "/".join(RECORD_SUFFIXES),
            shown,
            " ..." if len(ignored) > 5 else "",
        )
    return found


def open_binary(record: RecordFile) -> BinaryIO:
    """The file's bytes, decompressed."""
    if record.compression == ".gz":
        return gzip.open(record.path, "rb")
    if record.compression == ".zst":
        import zstandard

        # The decompressing reader reads, but does not iterate lines: buffered, it does both.
        return io.BufferedReader(zstandard.open(record.path, "rb"))
    return record.path.open("rb")


def lines(record: RecordFile) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line."""
    with open_binary(record) as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line
