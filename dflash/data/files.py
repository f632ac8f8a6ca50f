"""Which files hold records (conversations, prompts) and how to open them, for every reader.

A record file is `.jsonl`, `.json` or `.parquet` (any case), the JSON ones also compressed as
`.gz` or `.zst`. A directory written by `datasets`' `save_to_disk` (a Dataset or a DatasetDict)
is one record source, read whole; one whose Arrow shards lack the JSON files `save_to_disk`
writes beside them (state.json, dataset_info.json) is refused, naming the missing file, rather
than read as JSON records. Any other directory is read recursively: every record file
and saved dataset under it, sorted by path; hidden files and directories (a name starting with
'.', e.g. a lock) are passed over, and any other file is named in a warning with its count,
never read and never silently dropped.
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
# What `Dataset.save_to_disk` writes beside its Arrow shards (data-00000-of-00001.arrow, ...).
SAVED_DATASET_FILES = ("state.json", "dataset_info.json")
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


def is_saved_dataset(path: Path) -> bool:
    """A directory `datasets.Dataset.save_to_disk` or `DatasetDict.save_to_disk` wrote."""
    path = Path(path)
    if not path.is_dir():
        return False
    return (path / "dataset_dict.json").is_file() or all(
        (path / name).is_file() for name in SAVED_DATASET_FILES
    )


def refuse_incomplete_saved_dataset(directory: Path) -> None:
    """A directory holding `save_to_disk`'s Arrow shards without one of the JSON files written
    beside them: `load_from_disk` cannot open it, and read as a plain directory its
    dataset_info.json would be taken for records and blamed for not holding any."""
    if is_saved_dataset(directory):
        return
    shards = sorted(directory.glob("data-*-of-*.arrow"))
    missing = [name for name in SAVED_DATASET_FILES if not (directory / name).is_file()]
    if shards:
        raise ValueError(
            f"{directory}: a datasets save_to_disk directory ({shards[0].name}) without "
            f"{' and '.join(missing)}; save the dataset again with save_to_disk"
        )


def source_digest(path: Path) -> str:
    """What a record source holds, by content: a file's sha256, or for a saved dataset the
    sha256 of its files' names and digests (a cache keyed by it follows the data, not its name)."""
    from dflash.digest import file_digest

    if not is_saved_dataset(path):
        return file_digest(path)
    import hashlib

    inner = sorted(p for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith("."))
    listing = [(str(p.relative_to(path)), file_digest(p)) for p in inner]
    return hashlib.sha256(repr(listing).encode()).hexdigest()


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def files_under(directory: Path) -> list[Path]:
    """Every record file and saved dataset under `directory` (recursively, sorted); the other
    files are named in a warning with their count. A directory of Arrow shards that is not a
    whole saved dataset is refused (`refuse_incomplete_saved_dataset`)."""
    for candidate in (directory, *sorted(p for p in directory.rglob("*") if p.is_dir())):
        if not _hidden(candidate, directory) and not any(is_saved_dataset(d) for d in candidate.parents):
            refuse_incomplete_saved_dataset(candidate)
    saved = sorted(p for p in directory.rglob("*") if is_saved_dataset(p) and not _hidden(p, directory))
    # The outermost only: a DatasetDict's splits are saved Datasets of their own, read through it.
    datasets = [p for p in saved if not any(p != d and p.is_relative_to(d) for d in saved)]
    found, ignored = list(datasets), []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not _hidden(p, directory)):
        if any(path.is_relative_to(d) for d in datasets):
            continue  # a saved dataset's own files: read through it
        (found if record_file(path) is not None else ignored).append(path)
    found.sort()
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
