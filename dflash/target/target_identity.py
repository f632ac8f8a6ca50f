"""What a target is, by content rather than by the string that named it.

A drafter trained on one target is worthless on another of the same shape (a fine-tune, another
seed): it loads, decodes, and is accepted about never. A path is no identity either: the same
directory named with a trailing slash, through a link or after a move is the same target. So a
checkpoint records digests of what the target is made of (`target.json`), and resume,
`drafter.init_from` and `dflash-eval` compare those:
- config: the target's (text) config.json, without the fields that name rather than define it;
- weights: each weight file's size, its safetensors header (every tensor's name, dtype, shape
  and offset) and three 64 KiB samples of its bytes (start, middle, end): another checkpoint of
  the same shape differs there, and reading them costs milliseconds whatever the model's size;
- tokenizer: the vocabulary files of the tokenizer directory (target.tokenizer, else the path).
A random-weight target (no path) is its architecture and seed (and `target.fp8`, when set).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dflash.config.schema import TargetConfig

IDENTITY_FILE = "target.json"
SAMPLE_BYTES = 64 << 10
# config.json fields that name or describe the file rather than the model.
UNDEFINING_FIELDS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _sha(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()[:32]


def _config_digest(directory: Path) -> str | None:
    path = directory / "config.json"
    if not path.is_file():
        return None
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in UNDEFINING_FIELDS}
    return _sha(json.dumps(config, sort_keys=True).encode())


def _file_sample(path: Path) -> bytes:
    size = path.stat().st_size
    parts = [str(size).encode()]
    with path.open("rb") as handle:
        if path.suffix == ".safetensors" and size >= 8:
            header_len = int.from_bytes(handle.read(8), "little")
            parts.append(handle.read(min(header_len, size - 8)))
        for offset in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
            handle.seek(offset)
            parts.append(handle.read(SAMPLE_BYTES))
    return b"".join(parts)


def _weights_digest(directory: Path) -> str | None:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None
    return _sha(*(p.name.encode() + _file_sample(p) for p in files))


def _tokenizer_digest(directory: Path) -> str | None:
    files = [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]
    return _sha(*(p.name.encode() + p.read_bytes() for p in files)) if files else None


def target_identity(target: TargetConfig) -> dict[str, Any]:
    """The digests of `target` (a local directory: GGUF targets after their conversion)."""
    if target.path is None:
        random = {
            "model_type": target.model_type,
            "arch": dict(target.arch or {}),
            "init_seed": target.init_seed,
        }
        if target.fp8:  # other weights (quantized); named only when set, so earlier identities still match
            random["fp8"] = True
        return {"random": random}
    directory = Path(target.path)
    tokenizer_dir = Path(target.tokenizer) if target.tokenizer else directory
    return {
        "config": _config_digest(directory),
        "weights": _weights_digest(directory),
        "tokenizer": _tokenizer_digest(tokenizer_dir) if tokenizer_dir.is_dir() else None,
    }


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two identities, in words (a part either side lacks is not compared)."""
    names = {"config": "config.json", "weights": "weights", "tokenizer": "tokenizer vocabulary", "random": "random-init architecture or seed"}  # fmt: skip
    return [
        f"{names.get(part, part)} differ"
        for part in sorted(set(saved) & set(current))
        if saved[part] is not None and current[part] is not None and saved[part] != current[part]
    ]


def read_identity(directory: Path) -> dict[str, Any] | None:
    path = Path(directory) / IDENTITY_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def recorded_target(drafter_dir: Path) -> dict[str, Any] | None:
    """The identity of the target a drafter directory was made for, where it records one: its
    target.json (a dflash checkpoint), else the speculators config's verifier when that names a
    local checkpoint directory."""
    saved = read_identity(drafter_dir)
    if saved is not None:
        return saved
    try:
        config = json.loads((Path(drafter_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if isinstance(verifier, str) and verifier and Path(verifier).is_dir():
        return target_identity(TargetConfig(name="verifier", path=verifier))
    return None


def pairing_differences(drafter_dir: Path, target: TargetConfig) -> list[str]:
    """The one rule every tool that pairs a drafter with a target applies (resume,
    drafter.init_from, dflash-eval, dflash-export check/convert --target): what differs between
    the target the drafter records and `target`, by content; [] where nothing is recorded."""
    saved = recorded_target(drafter_dir)
    if saved is None:
        return []
    return identity_differences(saved, target_identity(target))
