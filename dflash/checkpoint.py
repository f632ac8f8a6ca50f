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
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash.export import speculators
from dflash.models.drafter import DFlashDrafter
from dflash.models.identity import IDENTITY_FILE, identity_differences, read_identity

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
RUN_CONFIG_FILE = "config.yaml"
EXPORTED_PREFIXES = ("layers.", "fc.", "hidden_norm.", "norm.")


def readable_by_every_transformers(config: dict[str, Any]) -> dict[str, Any]:
    """config.json fields as transformers 5 writes them, plus the forms transformers 4.x reads
    (the z-lab reference pins 4.57.1). transformers 5 keeps the rotary base and scaling only in
    `rope_parameters` and the dtype in `dtype`; 4.57 reads neither: it takes `rope_theta`
    (else 10000: a drafter trained at theta 1e6 would rotate at 1e4 there, and be accepted
    less, without an error), `rope_scaling` and `torch_dtype`. transformers 5 reads the legacy
    keys back into the same `rope_parameters` (tests/test_export.py reads an export with both)."""
    config = dict(config)
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        config["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    if "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    return config


def _exported_config(drafter: DFlashDrafter) -> dict[str, Any]:
    config = drafter.config.to_dict()
    config["dtype"] = str(next(drafter.parameters()).dtype).removeprefix("torch.")
    return readable_by_every_transformers(config)


def _write(directory: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weights = directory / WEIGHTS_FILE
    save_file(state, str(weights), metadata={"format": "pt"})
    # safetensors creates the file owner-only (0600); give it the mode config.json got from the
    # umask, so whoever may read the checkpoint (a serving job, a colleague) can read its weights.
    os.chmod(weights, (directory / CONFIG_FILE).stat().st_mode & 0o777)


def _drafter_tensors(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    return {
        name: tensor.detach().contiguous().cpu()
        for name, tensor in drafter.state_dict().items()
        if name.startswith(EXPORTED_PREFIXES)
    }


def export_drafter(drafter: DFlashDrafter, directory: Path) -> None:
    """Write config.json + model.safetensors in the layout inference engines load."""
    _write(Path(directory), _exported_config(drafter), _drafter_tensors(drafter))


def export_speculators(
    drafter: DFlashDrafter, directory: Path, *, verifier: dict[str, Any], target_dir: Path | None = None
) -> None:
    """The same drafter in the speculators layout (dflash/export/speculators.py); with the
    target's checkpoint directory, self-contained: its embedding and LM head bundled, in the
    drafter's dtype."""
    state = _drafter_tensors(drafter)
    if target_dir is not None:
        dtype = next(iter(state.values())).dtype
        tables = speculators.target_tables(Path(target_dir))
        hidden, vocab = drafter.config.hidden_size, drafter.config.vocab_size
        for name, table in tables.items():
            if tuple(table.shape) != (vocab, hidden):
                raise ValueError(
                    f"{target_dir}: its {name} is {list(table.shape)}, the drafter needs [{vocab}, {hidden}]: "
                    "another target than the drafter was trained for"
                )
            state[name] = table.to(dtype).contiguous()
    config = speculators.to_speculators(_exported_config(drafter), verifier=verifier)
    _write(Path(directory), config, state)


def _raw_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable drafter config ({exc})") from exc


def read_drafter_config(directory: Path) -> Qwen3Config:
    """The drafter config of a directory in the z-lab layout (ours) or the speculators one."""
    path = Path(directory) / CONFIG_FILE
    raw = _raw_config(directory)
    if speculators.is_speculators(raw):
        problems = speculators.speculators_problems(raw)
        if problems:
            raise ValueError(f"{path}: a speculators config dflash cannot read ({'; '.join(problems)})")
        raw = speculators.from_speculators(raw)
    missing = [key for key in ("block_size", "dflash_config") if key not in raw]
    if missing or "mask_token_id" not in raw.get("dflash_config", {}):
        raise ValueError(
            f"{path}: not a DFlash drafter config (missing {missing or ['dflash_config.mask_token_id']})"
        )
    return Qwen3Config.from_dict(raw)


# Drafter config fields a resumed run must share with its checkpoint, and the key that sets each.
RESUME_FIELDS = {
    "block_size": "drafter.block_size",
    "num_hidden_layers": "drafter.num_layers",
    "intermediate_size": "drafter.intermediate_size",
    "num_attention_heads": "drafter.num_attention_heads",
    "num_key_value_heads": "drafter.num_key_value_heads",
    "head_dim": "drafter.head_dim",
    "layer_types": "drafter.layer_types",
    "sliding_window": "drafter.sliding_window",
    "hidden_size": "target hidden size",
    "vocab_size": "target vocab size",
    "num_target_layers": "target layer count",
}
RESUME_TARGET_FIELDS = ("name", "path", "model_type", "init_seed", "arch")


def _target_differences(
    directory: Path, run_target: dict[str, Any], run_identity: dict[str, Any] | None
) -> list[tuple[str, Any, Any]]:
    """Which target a checkpoint was trained on, against this run's: by content where the
    checkpoint records it (dflash/models/identity.py), else by the run config's target fields
    (a path compared as the directory it names)."""
    saved_identity = read_identity(directory)
    # A random-init target is its config fields, compared below key by key (names the key).
    by_content = saved_identity is not None and run_identity is not None and "random" not in saved_identity
    if by_content:
        return [("target", difference, "this run's target") for difference in identity_differences(saved_identity, run_identity)]  # fmt: skip
    run_yaml = Path(directory) / RUN_CONFIG_FILE
    if not run_yaml.is_file():
        return []
    saved_target = (yaml.safe_load(run_yaml.read_text()) or {}).get("target", {})
    differences = []
    for name in RESUME_TARGET_FIELDS:
        old, new = saved_target.get(name), run_target.get(name)
        if name == "path" and old and new and Path(old).resolve() == Path(new).resolve():
            continue
        if old != new:
            differences.append((f"target.{name}", old, new))
    return differences


def check_resume_matches(
    directory: Path,
    run_config: Qwen3Config,
    run_target: dict[str, Any],
    key: str = "resume",
    run_identity: dict[str, Any] | None = None,
) -> None:
    """Refuse to resume (or, key="drafter.init_from", start) from a drafter trained for another
    drafter or target, naming both values. run_identity: this run's target by content
    (`target_identity`), compared with the checkpoint's target.json.

    Loading weights of the same shapes trained on other layer ids, another mask id or another
    target would run, and train a drafter that inference then misuses.
    """
    saved = read_drafter_config(directory)
    # The speculators layout records no target depth (its layer ids are checked against the
    # target's depth with every run's).
    unrecorded = {"num_target_layers"} if getattr(saved, "num_target_layers", None) is None else set()
    differences = [
        (key, getattr(saved, name, None), getattr(run_config, name, None))
        for name, key in RESUME_FIELDS.items()
        if name not in unrecorded and getattr(saved, name, None) != getattr(run_config, name, None)
    ]
    for name in ("target_layer_ids", "mask_token_id"):
        if saved.dflash_config.get(name) != run_config.dflash_config[name]:
            differences.append(
                (f"drafter.{name}", saved.dflash_config.get(name), run_config.dflash_config[name])
            )
    differences += _target_differences(Path(directory), run_target, run_identity)
    if differences:
        described = "; ".join(
            f"{field}: checkpoint {old!r}, this run {new!r}" for field, old, new in differences
        )
        raise ValueError(f"{key}={directory} was trained for another drafter or target ({described})")


def load_drafter_weights(drafter: DFlashDrafter, directory: Path) -> None:
    """model.safetensors of `directory` into `drafter`; every key must match both ways."""
    path = Path(directory) / WEIGHTS_FILE
    raw = _raw_config(directory)
    try:
        state = (
            speculators.drafter_state(path, raw) if speculators.is_speculators(raw) else load_file(str(path))
        )
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
    target_identity: dict[str, Any] | None = None,
) -> Path:
    """target_identity: what the target is by content, kept as target.json for resume,
    drafter.init_from and dflash-eval to compare."""
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
