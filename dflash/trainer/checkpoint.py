"""Atomic training checkpoints: an exported drafter (dflash.export.zlab) plus what resuming
needs, written into a temporary sibling and renamed into place, so a crash mid-write leaves the
previous checkpoint intact; `last` is a symlink swapped atomically after the rename.

    step_000200/
      config.json, model.safetensors   the drafter in the z-lab layout (fp32 master weights)
      trainer_state.pt    optimizer, LR schedule, RNG, data position: tensors and plain
                          containers only, loaded with weights_only=True (never arbitrary pickles)
      config.yaml         the resolved run config
      target.json         the target's identity by content (dflash.models.identity)
      data.json           what it trained on: files, digests, template, sizes (dflash.data.identity)
      README.md           the model card (dflash.export.card): target, shape, training, serving
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from dflash.data.identity import DATA_FILE
from dflash.export.card import TrainingFacts, write_model_card
from dflash.export.zlab import export_drafter
from dflash.models.drafter import DFlashDrafter
from dflash.models.identity import IDENTITY_FILE

STATE_FILE = "trainer_state.pt"
RUN_CONFIG_FILE = "config.yaml"


def save_checkpoint(
    root: Path,
    step: int,
    drafter: DFlashDrafter,
    trainer_state: dict[str, Any],
    run_config_yaml: str,
    keep_last: int,
    target_identity: dict[str, Any] | None = None,
    data_identity: dict[str, Any] | None = None,
    card: TrainingFacts | None = None,
) -> Path:
    """target_identity: what the target is by content, kept as target.json for resume,
    drafter.init_from and dflash-eval to compare. card: the training facts of its model card."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export_drafter(drafter, tmp)
        torch.save(trainer_state, tmp / STATE_FILE)
        (tmp / RUN_CONFIG_FILE).write_text(run_config_yaml)
        if target_identity is not None:
            (tmp / IDENTITY_FILE).write_text(json.dumps(target_identity, indent=2, sort_keys=True) + "\n")
        if data_identity is not None:
            (tmp / DATA_FILE).write_text(json.dumps(data_identity, indent=2, sort_keys=True) + "\n")
        write_model_card(tmp, card, served_from=str(final))
    except (OSError, SafetensorError, RuntimeError) as exc:
        # A full disk, a quota, a vanished mount (torch.save reports a failed write as a
        # RuntimeError): nothing half-written stays behind.
        shutil.rmtree(tmp, ignore_errors=True)
        last = root / "last"
        kept = (
            f"the previous checkpoint {last.resolve()} is intact"
            if last.exists()
            else "no earlier checkpoint"
        )
        raise OSError(
            getattr(exc, "errno", None),
            f"writing checkpoint {final} failed ({exc}); {kept}; free space or point hydra.run.dir "
            "elsewhere, then resume=",
        ) from exc
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
