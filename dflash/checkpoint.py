"""Drafter export (z-lab / SGLang / vLLM layout) and atomic training checkpoints.

A checkpoint directory is itself an exported drafter, plus what resuming needs:

    step_000200/
      config.json         HF config: model_type qwen3, architectures [DFlashDraftModel],
                          block_size, num_target_layers, dflash_config{mask_token_id, target_layer_ids}
      model.safetensors   layers.*, fc.weight, hidden_norm.weight, norm.weight (fp32 master weights)
      trainer_state.pt    optimizer, LR schedule, RNG, data position: tensors and plain
                          containers only, loaded with weights_only=True (never arbitrary pickles)
      config.yaml         the resolved run config

It is written into a temporary sibling and renamed into place, so a crash mid-write leaves the
previous checkpoint intact; `last` is a symlink swapped atomically after the rename.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash.models.drafter import DFlashDrafter

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
RUN_CONFIG_FILE = "config.yaml"
EXPORTED_PREFIXES = ("layers.", "fc.", "hidden_norm.", "norm.")


def export_drafter(drafter: DFlashDrafter, directory: Path) -> None:
    """Write config.json + model.safetensors in the layout inference engines load."""
    directory.mkdir(parents=True, exist_ok=True)
    config = drafter.config.to_dict()
    config["dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {
        name: tensor.detach().contiguous().cpu()
        for name, tensor in drafter.state_dict().items()
        if name.startswith(EXPORTED_PREFIXES)
    }
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})


def read_drafter_config(directory: Path) -> Qwen3Config:
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable drafter config ({exc})") from exc
    missing = [key for key in ("block_size", "dflash_config") if key not in raw]
    if missing or "mask_token_id" not in raw.get("dflash_config", {}):
        raise ValueError(
            f"{path}: not a DFlash drafter config (missing {missing or ['dflash_config.mask_token_id']})"
        )
    return Qwen3Config.from_dict(raw)


def load_drafter_weights(drafter: DFlashDrafter, directory: Path) -> None:
    """model.safetensors of `directory` into `drafter`; every key must match both ways."""
    path = Path(directory) / WEIGHTS_FILE
    try:
        state = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"{path}: unreadable drafter weights ({exc})") from exc
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"{path}: weights do not fit the drafter ({exc})") from exc


def load_drafter(directory: Path, device: torch.device | str = "cpu") -> DFlashDrafter:
    """A drafter defined only by config.json + model.safetensors (ours or any z-lab-layout export)."""
    drafter = DFlashDrafter(read_drafter_config(Path(directory)))
    load_drafter_weights(drafter, directory)
    return drafter.to(device)


def save_checkpoint(
    root: Path,
    step: int,
    drafter: DFlashDrafter,
    trainer_state: dict[str, Any],
    run_config_yaml: str,
    keep_last: int,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    export_drafter(drafter, tmp)
    torch.save(trainer_state, tmp / STATE_FILE)
    (tmp / RUN_CONFIG_FILE).write_text(run_config_yaml)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    link_tmp = root / ".last.tmp"
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(final.name)
    os.replace(link_tmp, root / "last")
    _prune(root, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[: max(0, len(steps) - keep_last)]:
        shutil.rmtree(old)


def load_trainer_state(directory: Path) -> dict[str, Any]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise ValueError(f"resume={directory}: no {STATE_FILE} there; is it a dflash checkpoint directory?")
    try:
        # weights_only: a checkpoint can never run code on load.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise ValueError(
            f"resume={directory}: {path.name} is corrupt or not a dflash trainer state ({exc})"
        ) from exc
