"""The model card (README.md in the Hugging Face format) written beside every drafter dflash
writes: each checkpoint directory, and each `dflash export convert`. It says what the drafter
drafts for (the target), its shape, how it was trained (data size, steps), what its last
evaluation measured, and the commands that serve it (docs/EXPORT.md).

Everything on it is read from the directory's own config.json and from `TrainingFacts` the
writer knows; nothing is estimated. A card is rewritten when a figure it shows changes (the final
evaluation, after the last checkpoint is written).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.drafter_registry import drafter_class_for

CARD_FILE = "README.md"
# A Hugging Face Hub model id (`org/name`), as opposed to a local path: what `base_model` takes.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True, kw_only=True)
class TrainingFacts:
    """What a card says about training, from the run that wrote the drafter."""

    target: str  # the target's name or path, as the run named it
    target_path: str | None = None  # the checkpoint the target loads from (what an engine serves)
    target_model_type: str | None = None  # the target config's model_type
    data: str  # the data source: a data option and its files
    samples: int | None  # training samples (the held-out split excluded)
    steps: int  # optimizer steps trained up to this checkpoint
    seed: int | None = None
    dflash_version: str | None = None
    # The last evaluation's figures (eval/... keys of summary.json); empty: not evaluated yet.
    evaluation: dict[str, Any] = field(default_factory=dict)


def model_card(drafter_config: dict[str, Any], facts: TrainingFacts | None, *, directory: str) -> str:
    """The card of a drafter whose config.json is `drafter_config`, stored at `directory`
    (the path the serving commands name)."""
    drafter_class = _drafter_class(drafter_config)
    shape = _shape(drafter_config, drafter_class)
    target = facts.target if facts is not None else "its target (trained elsewhere)"
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    front += ["tags:", "- dflash", "- speculative-decoding", "- block-diffusion", "- draft-model"]
    if facts is not None and _HUB_ID.match(facts.target):
        front.append(f"base_model: {facts.target}")
    front.append("---")
    block = shape["block_size"]
    lines = [
        *front,
        "",
        f"# {drafter_class.card_name} drafter for {target}",
        "",
        f"A block-diffusion speculative-decoding drafter: each round it proposes {block - 1 if block else '?'} "
        f"tokens at once for {target} to verify in one forward pass, so the output stays exactly the "
        "target's (greedy or sampled), only faster. It has no embedding or LM head of its own: it "
        "uses the target's.",
        *(["", drafter_class.card_words] if drafter_class.card_words else []),
        "",
        "## Shape",
        "",
        "| | |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in shape.items() if value is not None),
        "",
        "## Training",
        "",
    ]
    if facts is None:
        lines.append(
            "Trained outside dflash, or its run's facts were not at hand when this directory was written."
        )
    else:
        lines += [
            "| | |",
            "|---|---|",
            f"| target | `{facts.target}`"
            + (f" ({facts.target_model_type})" if facts.target_model_type else "")
            + " |",
            f"| data | {facts.data} |",
            f"| training samples | {facts.samples if facts.samples is not None else 'not recorded'} |",
            f"| optimizer steps | {facts.steps} |",
            *([f"| seed | {facts.seed} |"] if facts.seed is not None else []),
            *([f"| trained with | dflash {facts.dflash_version} |"] if facts.dflash_version else []),
        ]
    lines += ["", "## Evaluation", ""]
    lines += _evaluation(facts.evaluation if facts is not None else {})
    served = (facts.target_path if facts is not None else None) or "TARGET_MODEL_DIR"
    lines += ["", "## Serving", "", *_serving(served, directory, block), ""]
    return "\n".join(lines)


def write_model_card(directory: Path, facts: TrainingFacts | None, *, served_from: str | None = None) -> Path:
    """README.md in `directory`, from its config.json. `served_from`: the path the serving
    commands name (default: the directory itself)."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    path = directory / CARD_FILE
    staged = directory / f".{CARD_FILE}.tmp"  # replaced whole: a reader never sees half a card
    staged.write_text(model_card(config, facts, directory=served_from or str(directory)))
    os.replace(staged, path)
    return path


def _drafter_class(config: dict[str, Any]) -> type[DFlashDrafter]:
    """The registered drafter class a config.json describes, in either layout: z-lab's keeps a
    variant's fields in `dflash_config`, speculators' at the top level."""
    return drafter_class_for({**config, "dflash_config": {**config, **(config.get("dflash_config") or {})}})


def _shape(config: dict[str, Any], drafter_class: type[DFlashDrafter]) -> dict[str, Any]:
    """The shape a card shows, from either layout's config.json (z-lab or speculators)."""
    transformer = config.get("transformer_layer_config", config)  # speculators nests the layers' config
    dflash = config.get("dflash_config", {})
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None and "aux_hidden_state_layer_ids" in config:  # speculators: decoder layer + 1
        layer_ids = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
    layer_types = transformer.get("layer_types") or []
    sliding = sum(1 for kind in layer_types if kind == "sliding_attention")
    return {
        "architecture": ", ".join(config.get("architectures", [])) or None,
        "block_size": config.get("block_size", dflash.get("block_size")),
        "draft layers": transformer.get("num_hidden_layers"),
        "hidden size": transformer.get("hidden_size"),
        "attention heads (kv)": f"{transformer.get('num_attention_heads')} ({transformer.get('num_key_value_heads')})",
        "target layers read": f"{layer_ids} of {config.get('num_target_layers', '?')}" if layer_ids else None,
        "mask token id": dflash.get("mask_token_id", config.get("mask_token_id")),
        "sliding-window layers": f"{sliding} (window {transformer.get('sliding_window')})"
        if sliding
        else None,
        "vocabulary": transformer.get("vocab_size"),
        # The variant's own (dflash_config in the z-lab layout, top level in speculators')
        **{
            label: dflash.get(key, config.get(key))
            for label, key in drafter_class.card_fields
            if dflash.get(key, config.get(key)) is not None
        },
    }


def _evaluation(figures: dict[str, Any]) -> list[str]:
    if "eval/tau" not in figures:
        return [
            "Not evaluated at this step: `dflash eval ckpt=DIR` measures acceptance and losslessness "
            "(the last checkpoint of a run carries its final evaluation)."
        ]
    lines = [
        # eval/prompts: what the run decoded, in the summary's words (random tokens or benchmarks)
        f"Greedy decoding over {int(figures.get('eval/num_prompts', 0))} {figures.get('eval/prompts', 'prompts')}: "
        f"**tau {figures['eval/tau']:.3f}** tokens per target forward (acceptance length)"
        + (
            f", output identical to plain greedy decoding on {100 * figures['eval/lossless_frac']:.0f}% of prompts."
            if "eval/lossless_frac" in figures
            else "."
        ),
        "",
    ]
    rows = sorted(k for k in figures if re.fullmatch(r"eval/[^/]+/tau(_t[\d.]+)?", k))
    if rows:
        lines += ["| benchmark | tau | speedup |", "|---|---|---|"]
        for key in rows:
            name = key.split("/")[1] + (f" (temperature {key.split('_t')[-1]})" if "/tau_t" in key else "")
            speedup = figures.get(key.replace("/tau", "/speedup"))
            lines.append(
                f"| {name} | {figures[key]:.3f} | {f'{speedup:.2f}x' if speedup is not None else '-'} |"
            )
    return lines


def _serving(target: str, directory: str, block: int | None) -> list[str]:
    tokens = block or 16
    return [
        "The target serves; this directory drafts for it (docs/EXPORT.md in dflash says what each engine reads).",
        "",
        "```bash",
        "# SGLang",
        f"python -m sglang.launch_server --model-path {target} \\",
        f"  --speculative-algorithm DFLASH --speculative-draft-model-path {directory} \\",
        f"  --speculative-num-draft-tokens {tokens}",
        "# vLLM (0.20 or later)",
        f"vllm serve {target} \\",
        f'  --speculative-config \'{{"method": "dflash", "model": "{directory}", '
        f'"num_speculative_tokens": {tokens - 1}}}\'',
        "# dflash: acceptance and speedup on your prompts",
        f"dflash eval ckpt={directory}",
        "```",
    ]
