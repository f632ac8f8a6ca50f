"""The target families dflash trains drafters for, and how each one's checkpoint is read.

A checkpoint directory is read as its publisher wrote it. Two layouts occur:
- a causal LM (Llama 3.x, Qwen3, Qwen3-MoE, Qwen3-Next): config.json is the text model's config;
- an image-text model (Qwen3.5, Qwen3.5-MoE; Qwen3.6 checkpoints share their model_type): the
  text model's config sits under `text_config`, its weights under `model.language_model.*` with
  `lm_head` beside them, and a vision tower under `model.visual.*`. transformers' causal-LM
  class for these model types loads the language model alone (the vision weights are skipped
  on load, so they never reach a GPU), and its config is the `text_config`.

Everything dflash reads of a target's shape (layer count, hidden size, vocabulary, layer types)
comes from the text config, which `text_config` returns for both layouts. Nothing here imports
torch: config validation uses it before any weights load.
"""

from __future__ import annotations

from typing import Any

# model_type (outer config.json) -> the family it belongs to. Image-text types map their text
# model's own model_type (a config built from `text_config` alone, as the `*_random` presets do)
# to the same family.
SUPPORTED_FAMILIES: dict[str, str] = {
    "llama": "Llama 3.x",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "qwen3_next": "Qwen3-Next",
    "qwen3_5": "Qwen3.5 / Qwen3.6",
    "qwen3_5_text": "Qwen3.5 / Qwen3.6",
    "qwen3_5_moe": "Qwen3.5-MoE / Qwen3.6-MoE",
    "qwen3_5_moe_text": "Qwen3.5-MoE / Qwen3.6-MoE",
}

# Image-text model types whose language model is what dflash loads.
IMAGE_TEXT_TYPES = {"qwen3_5", "qwen3_5_moe"}


def supported_list() -> str:
    return ", ".join(sorted(t for t in SUPPORTED_FAMILIES if not t.endswith("_text")))


def refuse_unsupported(model_type: str, where: str) -> None:
    """One line naming the model_type and what is supported; `where` says which checkpoint or
    config key it came from."""
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"{where}: model_type {model_type!r} is not a supported target (supported: {supported_list()})"
        )


def text_config(config: Any) -> Any:
    """The language model's config: `text_config` of an image-text config, else the config."""
    if config.model_type in IMAGE_TEXT_TYPES:
        return config.get_text_config()
    return config


def model_types_of(config: Any) -> set[str]:
    """The names a `target.model_type` may use for this config: its own and its text model's."""
    return {config.model_type, text_config(config).model_type}
