"""Whether a target checkpoint's config describes the model its weight files hold, checked from
the config and the files' headers before any weights load.

transformers builds the model the config describes, then fills it from the weight files: a config
that describes far more (an image-text config.json without its `text_config`, whose defaults are
a 9B language model) allocates all of it first, and the process is killed for memory minutes
later with no record. Both cases are refused here in one line naming the path.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from dflash.target.families import IMAGE_TEXT_TYPES

# The config may describe somewhat more than the files hold (buffers, a head tied on load);
# beyond this factor it describes another model.
SIZE_TOLERANCE = 1.25


def refuse_missing_text_config(path: str | Path) -> None:
    """An image-text config.json whose language model is not described: transformers would
    silently build its default language model instead of the checkpoint's (its parsed config
    already holds those defaults, so the file itself is read)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return  # transformers has read it already; nothing more to learn here
    if raw.get("model_type") in IMAGE_TEXT_TYPES and not isinstance(raw.get("text_config"), dict):
        raise ValueError(
            f"target.path={path}: config.json (model_type {raw['model_type']!r}) has no text_config, so "
            "the language model's shape is not recorded (transformers would build its defaults instead "
            "of this checkpoint); use the checkpoint's published config.json"
        )


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as a safetensors header describes it."""

    file: Path
    dtype: str  # safetensors' name: "BF16", "F32", "F8_E4M3", ...
    shape: tuple[int, ...]


def stored_tensors(directory: Path) -> dict[str, StoredTensor]:
    """Every tensor in the directory's safetensors files, by name, read from their headers alone
    (no weight is read); empty where there are none (a .bin checkpoint is not checked)."""
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with file.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            tensors.update(
                (name, StoredTensor(file, str(t["dtype"]), tuple(t["shape"])))
                for name, t in header.items()
                if name != "__metadata__"
            )
        except (OSError, struct.error, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"target.path: {file} is not a readable safetensors file ({exc})") from exc
    return tensors


def weight_file_elements(directory: Path) -> int | None:
    """Parameters stored in the directory's safetensors files, read from their headers alone;
    None where there are none (a .bin checkpoint is not checked)."""
    tensors = stored_tensors(directory)
    if not tensors:
        return None
    return sum(math.prod(t.shape) for t in tensors.values())


def described_parameters(config: Any) -> int:
    """Parameters of the causal LM `config` describes, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def refuse_size_mismatch(path: str | Path, config: Any) -> None:
    """The language model `config` describes must fit in what the weight files hold (an
    image-text checkpoint holds its vision tower too: more is fine)."""
    if getattr(config, "quantization_config", None):  # packed weights: elements != parameters
        return
    stored = weight_file_elements(Path(path))
    if stored is None:
        return
    described = described_parameters(config)
    if described > SIZE_TOLERANCE * stored:
        raise ValueError(
            f"target.path={path}: config.json describes a language model of {described / 1e6:.1f}M "
            f"parameters, but its weight files hold {stored / 1e6:.1f}M: the config belongs to another "
            "model (or lacks a field its publisher wrote)"
        )
