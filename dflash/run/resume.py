"""Whether a drafter directory fits this run: a checkpoint to resume, or a drafter to start
from (drafter.init_from). Weights of the same shapes trained on other layer ids, another mask id
or another target would load and train a drafter that inference then misuses, so every field
that decides what a drafter means is compared, naming both values."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml
from transformers import Qwen3Config

from dflash.data.dataset import TokenDataset
from dflash.data.identity import appended, data_changes, read_data_identity
from dflash.drafters.drafter_registry import drafter_class_for, registered_drafters
from dflash.export.zlab import read_drafter_config
from dflash.target.target_identity import identity_differences, read_identity
from dflash.trainer.checkpoint import RUN_CONFIG_FILE

log = logging.getLogger(__name__)

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


def warm_starts_new_parts(saved: Qwen3Config, run_config: Qwen3Config, key: str) -> bool:
    """Whether drafter.init_from starts this run's drafter from one whose parts differ, as the
    run's drafter class answers (`DFlashDrafter.warm_starts`: a DFlash drafter starting a DSpark,
    DFlash2 or LiLiCorr run, a DFlash2 one starting LiLiCorr): the backbone's fields must still
    match and its weights load, and so must the fields of the parts both variants have
    (`variant_differences`); what the run's variant adds starts fresh and what only the source
    has is left out. A resume, or a start from the same variant, must match in every part."""
    if key != "drafter.init_from":
        return False
    return drafter_class_for(run_config).warm_starts(drafter_class_for(saved))


def variant_differences(saved: Qwen3Config, run_config: Qwen3Config, key: str) -> list[tuple[str, Any, Any]]:
    """The variants' own fields where a drafter directory and this run differ, as (run config
    key, saved value, run value). A resume, or a start from the same variant: every registered
    variant's fields. A warm start (`warm_starts_new_parts`): the run's variant's fields that the
    source records too, since the modules they shape load from it (DFlash2's convolutions
    starting LiLiCorr's: another `conv_kernel_size` would pass here and stop the loader at a
    tensor's shape, naming no key), and the source's fields that change what its backbone
    computes (`backbone_differences`: a released DFlash2's logit transforms). The fields only the
    run's variant adds (the source records none: None) shape the parts that start fresh; the
    source's other own fields (DFlash2's selector) are left out with their modules."""
    if not warm_starts_new_parts(saved, run_config, key):
        return [
            difference
            for drafter_class in registered_drafters().values()
            for difference in drafter_class.config_differences(saved, run_config)
        ]
    shared = [
        (field, old, new)
        for field, old, new in drafter_class_for(run_config).config_differences(saved, run_config)
        if old is not None
    ]
    return shared + drafter_class_for(saved).backbone_differences(saved, run_config)


def _target_differences(
    directory: Path, run_target: dict[str, Any], run_identity: dict[str, Any] | None
) -> list[tuple[str, Any, Any]]:
    """Which target a checkpoint was trained on, against this run's: by content where the
    checkpoint records it (dflash/target/target_identity.py), else by the run config's target fields
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
    differences += variant_differences(saved, run_config, key)
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


def check_resume_data(
    directory: Path, current: dict[str, Any], dataset: TokenDataset, *, accept_changes: bool
) -> None:
    """A resume continues its checkpoint's schedule position, which indexes the samples it
    trained on: other data (files, contents, template, appended samples) is refused naming what
    changed, unless `resume_changed_data=true` accepts it (then it is logged). Data grown by
    appending is trained, as the docs describe, by a new run from the drafter
    (`drafter.init_from=`: fresh schedule and split over the grown set)."""
    saved = read_data_identity(directory)
    if saved is None:
        log.warning("resume=%s records no training data (data.json): the data is not compared", directory)
        return
    changes = data_changes(saved, current, dataset)
    if not changes:
        return
    described = "; ".join(changes)
    if accept_changes:
        log.warning(
            "resume=%s continues on changed data (resume_changed_data=true): %s", directory, described
        )
        return
    fresh = f"drafter.init_from={directory} trains the grown set in a new run; " if appended(changes) else ""
    raise ValueError(
        f"resume={directory} trained on other data than this run's ({described}): resuming would "
        f"continue its schedule position on another sample set; {fresh}resume_changed_data=true "
        "continues on this data deliberately"
    )


def refuse_resume_past_end(directory: Path, step: int, stop_after: int) -> None:
    """A checkpoint at or past the step this run stops at leaves nothing to train."""
    if step >= stop_after:
        raise ValueError(
            f"resume={directory} is at step {step}, and this run ends at step {stop_after} "
            "(train.total_steps / train.epochs / debug.max_steps): nothing left to train; raise "
            f"train.total_steps to continue it, or evaluate it with dflash-eval ckpt={directory}"
        )
