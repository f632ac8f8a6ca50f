"""What a block-wise FP8 checkpoint must hold for dflash to read it as published, checked from
its config.json and its safetensors headers before any weight is read.

transformers checks neither: a quantized weight without its `weight_scale_inv` is used as stored
(its FP8 values unscaled, up to 448: the features' rms went from 0.075 to 104 in a run that
trained on), a scale grid of another shape is taken to describe another block size (or fails
deep in the loader), and a malformed `quantization_config` ends in a ZeroDivisionError or a
TypeError. Both loading paths of dflash/target/fp8.py (dequantized at load on the CPU, kept FP8
on CUDA) read only what these checks let through; each refusal is one line naming the file and
the key or tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash.target.size import StoredTensor, stored_tensors

QUANTIZATION = "quantization_config"
# The one FP8 format the published checkpoints store and dflash dequantizes (safetensors' name,
# the config's `fmt`).
FP8_STORED = "F8_E4M3"
FP8_FORMAT = "e4m3"
SCALE_SUFFIX = "_scale_inv"


def _refuse(where: str, field: str, value: Any, why: str) -> None:
    raise ValueError(f"{where}: {QUANTIZATION}.{field}={value!r}: {why}")


def fp8_block(quantization: Any, where: str) -> tuple[int, int] | None:
    """The block size of a block-wise FP8 `quantization_config` (as config.json holds it), after
    checking each field dflash or transformers reads; None for a config that is not block-wise
    FP8 (another method, or per-tensor FP8: transformers' own loaders). `where` names the file."""
    if not isinstance(quantization, dict):
        raise ValueError(f"{where}: {QUANTIZATION} must be a mapping of fields, got {quantization!r}")
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    method = quantization.get("quant_method")
    if not isinstance(method, str) or method not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        # transformers skips a config whose method it does not know: FP8 weights would then load
        # as stored, unscaled.
        _refuse(
            where,
            "quant_method",
            method,
            "not a quantization method transformers knows (fp8 for block-wise FP8)",
        )
    if method != "fp8":
        return None
    block = quantization.get("weight_block_size")
    if block is None:
        return None
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(type(side) is int and side > 0 for side in block)
    ):
        _refuse(where, "weight_block_size", block, "must be two positive integers, e.g. [128, 128]")
    scheme = quantization.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() != "dynamic":
        # A static scheme stores activation scales that dflash's FP8 modules never apply.
        _refuse(where, "activation_scheme", scheme, "block-wise FP8 is read with dynamic activations only")
    fmt = quantization.get("fmt", FP8_FORMAT)
    if fmt != FP8_FORMAT:
        # transformers ignores the field and reads whatever dtype the tensors hold.
        _refuse(where, "fmt", fmt, f"the weights must be float8 {FP8_FORMAT} (float8_e4m3fn), as published")
    skipped = quantization.get("modules_to_not_convert")
    if skipped is not None and not (isinstance(skipped, list) and all(isinstance(n, str) for n in skipped)):
        # transformers iterates it: a string would make each of its characters a module pattern.
        _refuse(where, "modules_to_not_convert", skipped, "must be a list of module names")
    _transformers_accepts(quantization, where)
    return block[0], block[1]


def _transformers_accepts(quantization: dict, where: str) -> None:
    """The fields transformers' FP8 config checks itself (scale_fmt, expert_dtype ...), refused
    here with the file named rather than from inside its loader."""
    from transformers import FineGrainedFP8Config

    try:
        FineGrainedFP8Config(**quantization)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"{where}: {QUANTIZATION} is not a valid FP8 config for transformers ({exc})"
        ) from exc


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The `weight_scale_inv` shape of an FP8 weight of `shape`: one scale per block, a partial
    last block included (leading dimensions, stacked experts, kept)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def misread_scale(tensors: dict[str, StoredTensor], block: tuple[int, int]) -> str | None:
    """The first tensor that transformers would read wrongly for want of a matching scale: an FP8
    weight in another float8 format, one without its `<name>_scale_inv`, a scale grid of another
    shape, or a scale whose weight is missing or not FP8. None when every scale fits."""
    for name, tensor in tensors.items():
        if not tensor.dtype.startswith("F8_") or name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype != FP8_STORED:
            return (
                f"{tensor.file}: {name} is {tensor.dtype}; FP8 weights must be {FP8_STORED} (float8_e4m3fn)"
            )
        expected = list(scale_grid(tensor.shape, block))
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            return (
                f"{tensor.file}: {name} {list(tensor.shape)} is FP8 but has no {name + SCALE_SUFFIX} "
                f"(expected shape {expected}: one scale per {block[0]} x {block[1]} block); "
                "it would be used unscaled"
            )
        if list(scale.shape) != expected:
            return (
                f"{scale.file}: {name + SCALE_SUFFIX} has shape {list(scale.shape)}, expected {expected} "
                f"(one scale per {block[0]} x {block[1]} block of {name} {list(tensor.shape)})"
            )
    for name, scale in tensors.items():
        if not name.endswith(SCALE_SUFFIX):
            continue
        weight = tensors.get(name.removesuffix(SCALE_SUFFIX))
        if weight is None or weight.dtype != FP8_STORED:  # a scale without its FP8 weight
            stored = "is missing" if weight is None else f"is {weight.dtype}, not {FP8_STORED}"
            return f"{scale.file}: {name} scales {name.removesuffix(SCALE_SUFFIX)}, which {stored}"
    return None


def check_fp8_checkpoint(path: str) -> tuple[int, int] | None:
    """`target.path`'s FP8 checkpoint refused in one line where its quantization_config is
    malformed or a weight's scale is missing or misshapen; returns its block size (None: not a
    block-wise FP8 checkpoint). Read from config.json itself, before transformers parses it (a
    quantization_config that is not a mapping breaks transformers' config reader). A local
    directory only: a hub id's files are not on disk until transformers fetches them."""
    directory = Path(path)
    config_file = directory / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None  # a hub id, or a config.json transformers reports as unreadable
    if not isinstance(raw, dict) or raw.get(QUANTIZATION) is None:
        return None
    block = fp8_block(raw[QUANTIZATION], f"target.path={path}: {config_file}")
    if block is not None:
        misread = misread_scale(stored_tensors(directory), block)
        if misread is not None:
            raise ValueError(f"target.path={path}: {misread}")
    return block
