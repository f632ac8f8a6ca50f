"""What a run trained on, recorded in every checkpoint (data.json) so that a resume can say what
changed: the data files and their content digests, the rendered template's identity (the
tokenizer and chat template fingerprint), the sizes, and a digest of the tokenized samples
themselves (what the schedule position indexes).

A resume on other samples continues a schedule position that indexes a different sample set
(some samples trained twice in the epoch, others never) and a validation split drawn from
another count: two runs mixed without a word. `data_changes` says what differs; the launcher
refuses unless the user accepts it by name (`resume_changed_data=true`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dflash.data.dataset import TokenDataset

DATA_FILE = "data.json"


def samples_digest(dataset: TokenDataset, count: int | None = None) -> str:
    """sha256 of the first `count` samples (all by default): their lengths, ids and masks."""
    count = len(dataset) if count is None else count
    end = int(dataset.offsets[count])
    digest = hashlib.sha256()
    digest.update(dataset.offsets[: count + 1].numpy())
    digest.update(dataset.input_ids[:end].numpy())
    digest.update(dataset.loss_mask[:end].numpy())
    return digest.hexdigest()


def data_identity(
    dataset: TokenDataset, *, kind: str, files: list[dict[str, str]] | None, template: str | None
) -> dict[str, Any]:
    """`files`: [{path, sha256}] in order (conversations); `template`: the renderer's fingerprint."""
    return {
        "kind": kind,
        "files": files,
        "template": template,
        "samples": len(dataset),
        "tokens": int(dataset.input_ids.numel()),
        "supervised_tokens": int(dataset.loss_mask.sum()),
        "samples_sha256": samples_digest(dataset),
    }


def read_data_identity(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / DATA_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def data_changes(saved: dict[str, Any], current: dict[str, Any], dataset: TokenDataset) -> list[str]:
    """What differs between the data a checkpoint trained on and this run's, one phrase each;
    empty when the samples are the same (a renamed or moved file with the same content is the
    same data)."""
    if saved["samples_sha256"] == current["samples_sha256"]:
        return []
    changes = []
    if saved.get("kind") != current.get("kind"):
        changes.append(f"data.kind {saved.get('kind')} -> {current.get('kind')}")
    old_files, new_files = saved.get("files") or [], current.get("files") or []
    old_digests = {f["sha256"]: f["path"] for f in old_files}
    new_digests = {f["sha256"] for f in new_files}
    for file in new_files:
        if file["sha256"] not in old_digests:
            changes.append(f"data.files: {file['path']} is new or changed")
    for digest, path in old_digests.items():
        if digest not in new_digests:
            changes.append(f"data.files: {path} (as trained on) is no longer read")
    if saved.get("template") != current.get("template"):
        changes.append("the tokenizer or chat template renders differently")
    grown = current["samples"] > saved["samples"]
    if grown and samples_digest(dataset, saved["samples"]) == saved["samples_sha256"]:
        changes.append(
            f"data grew by appending: {saved['samples']} -> {current['samples']} samples, the first "
            f"{saved['samples']} unchanged"
        )
    else:
        if saved["samples"] != current["samples"]:
            changes.append(f"{saved['samples']} -> {current['samples']} samples")
        changes.append("the tokenized samples differ")
    return changes


def appended(changes: list[str]) -> bool:
    return any(change.startswith("data grew by appending") for change in changes)
