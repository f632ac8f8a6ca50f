"""Atomic training checkpoints: an exported drafter (dflash.export.zlab) plus what resuming
needs, written into a temporary sibling and renamed into place, so a crash mid-write leaves the
previous checkpoint intact.

`last` is a real directory of hard links to the newest checkpoint's files (no copy: the same
bytes), not a symlink: `cp -r RUN/checkpoints/last X` copies a checkpoint, where a relative link
would arrive dangling. It is built beside the old one and swapped in with one rename
(`publish_last`), so a reader sees the old `last` or the new one, whole; it is published again
whenever a file is added to its checkpoint (the trackers' run records, the final model card).

    step_000200/
      config.json, model.safetensors   the drafter in the z-lab layout (fp32 master weights)
      trainer_state.pt    optimizer, LR schedule, RNG, data position: tensors and plain
                          containers only, loaded with weights_only=True (never arbitrary pickles)
      config.yaml         the resolved run config
      target.json         the target's identity by content (dflash.target.target_identity)
      data.json           what it trained on: files, digests, template, sizes (dflash.data.identity)
      README.md           the model card (dflash.export.card): target, shape, training, serving
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from dflash.data.identity import DATA_FILE
from dflash.drafters.backbone import DFlashDrafter
from dflash.export.card import TrainingFacts, write_model_card
from dflash.export.zlab import export_drafter
from dflash.target.target_identity import IDENTITY_FILE

STATE_FILE = "trainer_state.pt"
RUN_CONFIG_FILE = "config.yaml"
LAST = "last"


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
        last = root / LAST
        previous = checkpoint_behind_last(root) or last
        kept = (
            f"the previous checkpoint {previous.resolve()} is intact"
            if last.exists()
            else "no earlier checkpoint"
        )
        raise OSError(
            getattr(exc, "errno", None),
            f"writing checkpoint {final} failed ({exc}); {kept}; free space or point hydra.run.dir "
            "elsewhere, then resume=",
        ) from exc
    # The same step written again (a resume from an earlier step): the old one is moved aside
    # first, so a signal between the renames leaves it under a hidden name, never half deleted.
    replaced = root / f".old-{final.name}"
    _remove(replaced)
    if final.exists():
        os.replace(final, replaced)
    os.replace(tmp, final)
    _remove(replaced)
    publish_last(root, final)
    _prune(root, keep_last)
    return final


def publish_last(root: Path, checkpoint: Path) -> Path:
    """`root/last` as a directory of hard links to `checkpoint`'s files (copies where the
    filesystem has no hard links), swapped in whole for the previous `last`."""
    staged = root / ".last.new"
    _remove(staged)
    _remove(root / f".{LAST}.old")  # left by a crash inside `_swap_in`'s fallback
    shutil.copytree(checkpoint, staged, copy_function=_link_or_copy, ignore=shutil.ignore_patterns(".*"))
    last = root / LAST
    if os.path.lexists(last):
        _remove(_swap_in(staged, last))  # the previous `last` (a symlink, from older runs, too)
    else:
        os.rename(staged, last)
    return last


def checkpoint_behind_last(root: Path) -> Path | None:
    """The step directory `last` holds the files of (its trainer state is the same file), or
    None where `last` holds copies or its step is gone."""
    state = root / LAST / STATE_FILE
    if not state.is_file():
        return None
    return next((step for step in sorted(root.glob("step_*")) if _same_file(step / STATE_FILE, state)), None)


def _same_file(a: Path, b: Path) -> bool:
    return a.is_file() and os.path.samefile(a, b)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # a filesystem without hard links (some network and FUSE mounts)
        shutil.copy2(source, destination)


# Linux renameat2(2): RENAME_EXCHANGE swaps two existing paths in one step.
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
# What a kernel, C library or filesystem without the exchange answers.
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP)


def _swap_in(staged: Path, target: Path) -> Path:
    """`staged` renamed to `target`, whose previous entry is returned (to be removed). Swapped in
    one step where the system can; elsewhere the old entry is moved aside first, which leaves a
    moment without `target` (a crash there keeps the old one as `.last.old`, removed next time)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(staged), _AT_FDCWD, os.fsencode(target), _RENAME_EXCHANGE) == 0:
            return staged
        code = ctypes.get_errno()
        if code not in _NO_EXCHANGE:
            raise OSError(code, os.strerror(code), str(target))
    aside = target.with_name(f".{target.name}.old")
    _remove(aside)
    os.rename(target, aside)
    os.rename(staged, target)
    return aside


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


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
