"""The speculators layout of a DFlash drafter (vLLM's `speculators` library trains and writes
it; vLLM serves it), read and written beside the z-lab layout dflash exports by default.

What differs from the z-lab layout (docs/EXPORT.md, "The speculators layout"):
- config.json nests the draft layers' Qwen3 config under `transformer_layer_config` and keeps
  the DFlash fields at the top: `speculators_model_type: dflash`, `block_size`, `mask_token_id`,
  `draft_vocab_size`, `target_hidden_size`, and `speculators_config` (algorithm, greedy proposal
  of block_size - 1 tokens, the verifier's name and architectures);
- the target layers are `aux_hidden_state_layer_ids`, indices into the target's hidden-state
  list whose entry 0 is the embedding output: decoder layer i is aux id i + 1 (vLLM's own
  reader subtracts 1 to get `dflash_config.target_layer_ids`);
- the weights may bundle the target's `embed_tokens.weight` and `lm_head.weight` (a
  self-contained drafter); a reduced draft vocabulary (`d2t` / `t2d` maps) is refused: a dflash
  drafter scores with the target's whole LM head.

A variant's model type, class, fields and refusals here are its registered export rules
(`VariantExport.speculators_*`, dflash/export/rules.py): DSpark's in dflash/export/deepspec.py,
DFlash2's in dflash/export/dflash2_rules.py; the number of tokens a block proposes is the drafter
class's `drafts_for`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash.export.rules import VariantExport

BUNDLED_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # the target's, [vocab, hidden]
VOCAB_MAPS = ("d2t", "t2d")
# speculators_model_type -> the registered variant's rules (dflash/export/export_registry.py).
Known = Mapping[str, VariantExport]


def is_speculators(config: dict[str, Any]) -> bool:
    return "speculators_model_type" in config


def speculators_problems(config: dict[str, Any], known: Known) -> list[str]:
    """What keeps a speculators config from being a DFlash drafter dflash can read."""
    problems = []
    kind = config.get("speculators_model_type")
    spec = known.get(kind)
    if spec is None:
        types = list(known)
        listed = ", ".join(map(repr, types[:-1])) + f" or {types[-1]!r}"
        problems.append(f"speculators_model_type {kind!r} is not {listed}")
    else:
        config = {**spec.speculators_defaults, **config}
        problems += spec.speculators_problems(config)
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return problems + ["no transformer_layer_config (the draft layers' Qwen3 config)"]
    for key in ("mask_token_id", "aux_hidden_state_layer_ids", "block_size"):
        if config.get(key) is None:
            problems.append(f"{key} is missing")
    aux = config.get("aux_hidden_state_layer_ids") or []
    if any(not isinstance(i, int) or i < 1 for i in aux):
        problems.append(
            f"aux_hidden_state_layer_ids {aux}: each must be >= 1 (0 is the embedding output, not a layer)"
        )
    vocab = layer.get("vocab_size")
    if config.get("draft_vocab_size") not in (None, vocab):
        problems.append(
            f"draft_vocab_size {config['draft_vocab_size']} differs from the target's {vocab}: a reduced "
            "draft vocabulary is not supported (dflash drafts with the target's whole LM head)"
        )
    hidden = config.get("target_hidden_size")
    if hidden is not None and hidden != layer.get("hidden_size"):
        problems.append(
            f"target_hidden_size {hidden} differs from the draft layers' hidden_size {layer.get('hidden_size')}"
        )
    if (
        "sliding_attention" in (layer.get("layer_types") or [])
        and config.get("sliding_window_non_causal") is not True
    ):
        problems.append(
            "sliding layers with sliding_window_non_causal false: a causal block, which dflash does not train or decode"
        )
    return problems


def serving_problems(config: dict[str, Any], known: Known) -> list[str]:
    """What speculators' loader and vLLM's speculators path read beyond what dflash reads (a
    config speculators_problems accepts): the class, and `speculators_config`, which vLLM's
    config reader indexes (the algorithm, the first proposal method's length, the verifier's
    name) and fails without."""
    kind = config["speculators_model_type"]
    spec = known[kind]
    problems = []
    architecture = spec.speculators_architecture
    if config.get("architectures") != [architecture]:
        why = spec.speculators_class_reason
        problems.append(f"architectures is {config.get('architectures')!r}, not [{architecture!r}] ({why})")
    settings = config.get("speculators_config")
    if not isinstance(settings, dict):
        return problems + [
            f"speculators_config is {settings!r}: vLLM reads the proposal length and the verifier there "
            "(and refuses the config without them)"
        ]
    if settings.get("algorithm") != kind:
        problems.append(f"speculators_config.algorithm is {settings.get('algorithm')!r}, not {kind!r}")
    block, methods = config.get("block_size"), settings.get("proposal_methods")
    proposed = [m.get("speculative_tokens") if isinstance(m, dict) else m for m in methods or []]
    if isinstance(block, int):
        # A variant whose every block slot predicts drafts the whole block; otherwise slot 0 is
        # the given token.
        drafted = spec.drafter.drafts_for(block)
        why = "every slot predicts" if drafted == block else "position 0 is the given token"
        if proposed != [drafted]:
            problems.append(
                f"speculators_config proposes {proposed} tokens; a block of {block} drafts {drafted} ({why})"
            )
    verifier = settings.get("verifier")
    if not isinstance(verifier, dict) or not verifier.get("name_or_path"):
        problems.append(
            "speculators_config.verifier.name_or_path is missing: vLLM refuses the config without it"
        )
    return problems + spec.speculators_serving_problems(config)


def from_speculators(config: dict[str, Any], known: Known) -> dict[str, Any]:
    """The z-lab config.json of a speculators DFlash config (speculators_problems must be [])."""
    spec = known[config["speculators_model_type"]]
    config = {**spec.speculators_defaults, **config}
    zlab = dict(config["transformer_layer_config"])
    zlab["architectures"] = [spec.zlab_architecture]
    zlab["block_size"] = config["block_size"]
    zlab["dflash_config"] = {
        "mask_token_id": config["mask_token_id"],
        "target_layer_ids": [i - 1 for i in config["aux_hidden_state_layer_ids"]],
    }
    if config.get("sliding_window_non_causal"):
        zlab["is_causal"] = False
    # The speculators layout records no target depth; pairing with a target checks the ids.
    zlab.pop("num_target_layers", None)
    spec.zlab_from_speculators(config, zlab)
    return zlab


def to_speculators(zlab: dict[str, Any], *, spec: VariantExport, verifier: dict[str, Any]) -> dict[str, Any]:
    """The speculators config.json of a z-lab DFlash config; verifier: {name_or_path, architectures}.
    ValueError when the variant has no speculators form (or this drafter none: `speculators_fields`)."""
    algorithm = spec.speculators_type
    if algorithm is None:
        raise ValueError(
            f"a {spec.drafter.display_name} drafter has no speculators model type: the speculators layout "
            "cannot name it"
        )
    fields = spec.speculators_fields(zlab)
    layer = {key: value for key, value in zlab.items() if key not in spec.speculators_top_fields}
    dflash = zlab["dflash_config"]
    sliding = "sliding_attention" in (zlab.get("layer_types") or [])
    return {
        "speculators_model_type": algorithm,
        "architectures": [spec.speculators_architecture],
        "transformer_layer_config": layer,
        "block_size": zlab["block_size"],
        "mask_token_id": dflash["mask_token_id"],
        "aux_hidden_state_layer_ids": [i + 1 for i in dflash["target_layer_ids"]],
        "draft_vocab_size": zlab["vocab_size"],
        "target_hidden_size": zlab["hidden_size"],
        # Every dflash layer sees its block bidirectionally; speculators' default for a sliding
        # layer is causal.
        "sliding_window_non_causal": sliding or zlab.get("is_causal") is False,
        "speculators_config": {
            "algorithm": algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": spec.drafter.drafts_for(zlab["block_size"])}
            ],
            "verifier": verifier,
        },
        **fields,
    }


def drafter_state(path: Path, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A speculators model.safetensors as the drafter's own tensors: the bundled target tables
    are left out (the run's target provides them), a vocabulary map is refused."""
    with safe_open(str(path), "pt") as handle:
        names = list(handle.keys())
        maps = [name for name in names if name in VOCAB_MAPS]
        if maps:
            raise ValueError(
                f"{path}: holds {maps}, a reduced draft vocabulary (draft_vocab_size "
                f"{config.get('draft_vocab_size')}); dflash drafts with the target's whole LM head"
            )
        return {name: handle.get_tensor(name) for name in names if name not in BUNDLED_TENSORS}


def target_tables(target_dir: Path) -> dict[str, torch.Tensor]:
    """The target's embedding and LM head from its safetensors (one file or an index), under the
    names a self-contained speculators drafter bundles them; a tied head is the embedding."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        files = json.loads(index.read_text())["weight_map"]
    else:
        single = target_dir / "model.safetensors"
        if not single.is_file():
            raise ValueError(
                f"{target_dir}: no model.safetensors(.index.json) to take the embedding and LM head from"
            )
        with safe_open(str(single), "pt") as handle:
            files = {name: single.name for name in handle.keys()}
    # The language model's table: an image-text checkpoint also holds a vision tower's.
    embed = sorted(
        (name for name in files if name.endswith("embed_tokens.weight")), key=lambda n: "visual" in n
    )
    if not embed:
        raise ValueError(f"{target_dir}: no embed_tokens.weight among the target's tensors")
    head = "lm_head.weight" if "lm_head.weight" in files else embed[0]
    tables = {}
    for bundled, name in (("embed_tokens.weight", embed[0]), ("lm_head.weight", head)):
        with safe_open(str(target_dir / files[name]), "pt") as handle:
            tables[bundled] = handle.get_tensor(name)
    return tables
