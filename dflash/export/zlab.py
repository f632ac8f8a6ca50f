"""The drafter directory in the z-lab layout (what the z-lab reference, SGLang and vLLM load):
writing it, reading it back, and whether one fits a run (resume, drafter.init_from).

A training checkpoint (dflash.trainer.checkpoint) is such a directory plus what resuming needs:

    step_000200/
      config.json         HF config: model_type qwen3, architectures [DFlashDraftModel],
                          block_size, num_target_layers, dflash_config{mask_token_id, target_layer_ids}
      model.safetensors   layers.*, fc.weight, hidden_norm.weight, norm.weight (fp32 master weights)
      trainer_state.pt    optimizer, LR schedule, RNG, data position: tensors and plain
                          containers only, loaded with weights_only=True (never arbitrary pickles)
      config.yaml         the resolved run config

A DSpark drafter's directory is written in DeepSpec's layout instead (dflash/export/deepspec.py:
`architectures: [Qwen3DSparkModel]`, the heads' fields and tensors), the one its readers load. A
DFlash2 drafter's is the z-lab layout of the released DFlash2 checkpoints: `architectures:
[DFlash2DraftModel]`, its four fields inside `dflash_config`, the convolution and selector
tensors beside the backbone's (dflash/export/dflash2_rules.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.drafter_class import drafter_from_config
from dflash.drafters.drafter_registry import drafter_class_for
from dflash.drafters.plugin_record import unregistered_variant, variant_record
from dflash.export import speculators
from dflash.export.export_registry import export_for, export_for_config, layout_named, layout_of

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# The backbone's tensors; a subclass's added modules (DSpark's heads, DFlash2's selector) are
# exported too, under the names their reference checkpoints use (`added_modules`).
BACKBONE_PREFIXES = ("layers.", "fc.", "hidden_norm.", "norm.")


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
    """The drafter's config.json in memory form (z-lab fields, plus a DSpark drafter's heads)."""
    config = drafter.config.to_dict()
    config.update(variant_record(type(drafter)))  # a plug-in's variant names itself; {} for ours
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


def exported_state(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The drafter's tensors an export holds, under their names (a meta-device drafter's too)."""
    exported = BACKBONE_PREFIXES + tuple(f"{module}." for module in drafter.added_modules)
    return {name: tensor for name, tensor in drafter.state_dict().items() if name.startswith(exported)}


def _drafter_tensors(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().contiguous().cpu() for name, tensor in exported_state(drafter).items()}


def write_layout(
    drafter: DFlashDrafter,
    directory: Path,
    layout: str,
    *,
    target_dir: Path | None = None,
    verifier: dict[str, Any] | None = None,
) -> None:
    """The drafter in one of the layouts its variant declares (dflash/export/export_registry.py), with
    the target's embedding and LM head bundled (in the drafter's dtype) where the layout holds
    them and `target_dir` gives them; a layout that must hold them refuses to be written
    without. ValueError for a layout the variant does not declare."""
    spec = export_for(drafter)
    if layout not in spec.layouts:
        raise ValueError(
            f"a {drafter.display_name} drafter is not written in the {layout} layout (it declares "
            f"{', '.join(spec.layouts)})"
        )
    chosen = layout_named(layout)
    state = _drafter_tensors(drafter)
    if chosen.bundled and target_dir is not None:
        state.update(_target_tables(drafter, Path(target_dir), next(iter(state.values())).dtype))
    elif chosen.tables_required:
        raise ValueError(f"the {layout} layout needs the target's tables: {chosen.tables_required}")
    config = chosen.from_zlab(_exported_config(drafter), spec=spec, verifier=verifier)
    _write(Path(directory), config, state)


def export_drafter(drafter: DFlashDrafter, directory: Path) -> None:
    """Write config.json + model.safetensors in the layout inference engines load: the drafter's
    `native_layout` (z-lab for a DFlash or DFlash2 drafter, DeepSpec's for a DSpark one)."""
    write_layout(drafter, directory, drafter.native_layout)


def _target_tables(drafter: DFlashDrafter, target_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The target's embedding and LM head, checked against the drafter's [vocab, hidden]."""
    tables = speculators.target_tables(target_dir)
    hidden, vocab = drafter.config.hidden_size, drafter.config.vocab_size
    for name, table in tables.items():
        if tuple(table.shape) != (vocab, hidden):
            raise ValueError(
                f"{target_dir}: its {name} is {list(table.shape)}, the drafter needs [{vocab}, {hidden}]: "
                "another target than the drafter was trained for"
            )
    return {name: table.to(dtype).contiguous() for name, table in tables.items()}


def _raw_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable drafter config ({exc})") from exc


def read_drafter_config(directory: Path) -> Qwen3Config:
    """The drafter config of a directory in the z-lab layout (a DFlash or DFlash2 drafter: ours, or
    z-lab's released ones), DeepSpec's (a DSpark one: ours, or DeepSpec's released checkpoints) or
    the speculators one (any of them)."""
    path = Path(directory) / CONFIG_FILE
    raw = _raw_config(directory)
    layout = layout_of(raw)
    problems = layout.problems(raw)
    if problems:
        raise ValueError(f"{path}: {layout.described} dflash cannot read ({'; '.join(problems)})")
    raw = layout.to_zlab(raw)
    nested = raw.get("dflash_config") or {}
    if "block_size" not in raw and "block_size" in nested:
        # The released DFlash2 configs keep it there; the reference and SGLang read either place.
        raw = {**raw, "block_size": nested["block_size"]}
    spec = export_for_config(raw)
    problems = spec.field_problems(raw)
    if problems:
        name = spec.drafter.display_name
        raise ValueError(f"{path}: a {name} config dflash cannot read ({'; '.join(problems)})")
    missing = [key for key in ("block_size", "dflash_config") if key not in raw]
    if missing or "mask_token_id" not in raw.get("dflash_config", {}):
        raise ValueError(
            f"{path}: not a DFlash drafter config (missing {missing or ['dflash_config.mask_token_id']})"
        )
    # In z-lab form, whichever layout it was read from (speculators nests the record): a plug-in's
    # variant this process lacks is refused here, before any reader takes it for the backbone.
    unregistered = unregistered_variant(raw)
    if unregistered:
        raise ValueError(f"{path}: {unregistered}")
    return Qwen3Config.from_dict(raw)


def nonfinite_problem(path: Path, name: str, tensor: torch.Tensor) -> str | None:
    """Why tensor `name` of `path` must not be served, when it holds NaN or inf: every reader
    loads it without a word and drafts nothing the target accepts (a run that diverged, a
    corrupted copy). The one rule `dflash export check` and this loader apply."""
    if not tensor.is_floating_point():
        return None
    bad = int(tensor.numel() - torch.isfinite(tensor).sum())
    if not bad:
        return None
    return f"{path}: tensor {name} holds {bad} non-finite values (NaN or inf) of {tensor.numel()}"


def shape_mismatch(path: Path, state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> str | None:
    """One line naming the first tensor of `path` whose shape is not the drafter's, both shapes
    and how many more differ; None when every shared tensor fits. torch's own refusal lists each
    tensor on a line of its own and names no file: the preflight compares the configs first
    (dflash/run/resume.py), so this is the net under what they do not describe."""
    misshapen = [name for name, tensor in state.items() if name in own and tensor.shape != own[name].shape]
    if not misshapen:
        return None
    name = misshapen[0]
    more = f" (and {len(misshapen) - 1} more tensors of other shapes)" if len(misshapen) > 1 else ""
    return (
        f"{path}: tensor {name} is {list(state[name].shape)} there, {list(own[name].shape)} in the "
        f"drafter{more}: the drafter's config describes other weights"
    )


def load_drafter_weights(drafter: DFlashDrafter, directory: Path, *, new_parts: bool = False) -> None:
    """model.safetensors of `directory` into `drafter`; every key must match both ways, except,
    with `new_parts` (a DFlash drafter warm-starting a DSpark or DFlash2 one), the modules the
    drafter's class adds to DFlash (`added_modules`: DSpark's heads, DFlash2's convolutions and
    selector) and the directory's variant does not have: they keep their fresh init (DFlash2's
    convolutions the identity, so the warm-started drafter starts as the DFlash it was)."""
    path = Path(directory) / WEIGHTS_FILE
    raw = _raw_config(directory)
    layout = layout_of(raw)
    try:
        if layout.read_state is not None:
            state = layout.read_state(path, raw)
        else:
            # A layout bundling the target's tables: the run's target provides them.
            state = {name: t for name, t in load_file(str(path)).items() if name not in layout.bundled}
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"{path}: unreadable drafter weights ({exc})") from exc
    nonfinite = [
        problem for name, tensor in state.items() if (problem := nonfinite_problem(path, name, tensor))
    ]
    if nonfinite:
        raise ValueError("; ".join(nonfinite))
    misshapen = shape_mismatch(path, state, drafter.state_dict())
    if misshapen:
        raise ValueError(misshapen)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if new_parts:
        added = set(drafter.added_modules)
        brought = set(drafter_class_for(read_drafter_config(directory)).added_modules)
        # Only what the source's variant lacks starts fresh: a module both have (DFlash2's
        # convolutions starting LiLiCorr's) must load whole, or a lost tensor would train from init.
        fresh = added - brought
        missing = [name for name in missing if fresh.isdisjoint(name.split("."))]
        # A variant it warm-starts from (`warm_starts_from`) brings modules of its own this one
        # replaces (DFlash2's selector): left out. A module both have must still fit.
        left_out = brought - added
        unexpected = [name for name in unexpected if left_out.isdisjoint(name.split("."))]
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not fit the drafter (missing: {missing or 'none'}; "
            f"unexpected: {unexpected or 'none'})"
        )


def load_drafter(directory: Path, device: torch.device | str = "cpu") -> DFlashDrafter:
    """A drafter defined only by config.json + model.safetensors (ours, a z-lab-layout export, a
    released DFlash2 one, a DeepSpec or speculators checkpoint): a DSparkDrafter when the config
    has the heads' fields, a DFlash2Drafter when its dflash_config sets the selector."""
    drafter = drafter_from_config(read_drafter_config(Path(directory)))
    load_drafter_weights(drafter, directory)
    return drafter.to(device)
