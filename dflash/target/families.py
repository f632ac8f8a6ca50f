"""The target families dflash trains drafters for (`TARGET_FAMILIES`, one record each), and how
each one's checkpoint is read. The loader, the static decoder, the test fixtures and the README's
supported list all follow the table: a new family is one record here (plus its tiny checkpoint in
tests/conftest.py).

A checkpoint directory is read as its publisher wrote it. Two layouts occur:
- a causal LM: config.json is the text model's config;
- an image-text model (`image_text`; Qwen3.6 checkpoints share Qwen3.5's model_type): the text
  model's config sits under `text_config`, its weights under `model.language_model.*` with
  `lm_head` beside them, and a vision tower under `model.visual.*`. transformers' causal-LM
  class for these model types loads the language model alone (the vision weights are skipped
  on load, so they never reach a GPU), and its config is the `text_config`.

Everything dflash reads of a target's shape (layer count, hidden size, vocabulary, layer types)
comes from the text config, which `text_config` returns for both layouts. Nothing here imports
torch: config validation uses it before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class TargetFamily:
    name: str  # as the README lists it
    model_type: str  # config.json's model_type as published
    image_text: bool = False  # the text model under `text_config`, a vision tower beside it
    static_decoding: bool = True  # dflash/decoding/static_target.py runs its decoder layers
    presets: tuple[str, ...] = ()  # the conf/target options of this family

    @property
    def text_model_type(self) -> str:
        """The language model's own model_type (what a config built from `text_config` alone,
        as the `*_random` presets build, and the loaded model carry)."""
        return f"{self.model_type}_text" if self.image_text else self.model_type


TARGET_FAMILIES: tuple[TargetFamily, ...] = (
    TargetFamily("Llama 3.x", "llama", presets=("smollm2_135m",)),
    TargetFamily("Mistral", "mistral"),
    TargetFamily("Qwen2", "qwen2"),
    TargetFamily("Qwen3", "qwen3", presets=("tiny", "qwen3_8b", "qwen3_8b_random", "qwen3_8b_fp8_random")),
    TargetFamily("Qwen3-MoE", "qwen3_moe"),
    TargetFamily(
        "Qwen3-Next",
        "qwen3_next",
        presets=("qwen3_next_80b", "qwen3_next_80b_random", "qwen3_next_80b_fp8_random"),
    ),
    TargetFamily("Qwen3.5 / Qwen3.6", "qwen3_5", image_text=True, presets=("qwen3_5", "qwen3_5_9b_random")),
    TargetFamily(
        "Qwen3.5-MoE / Qwen3.6-MoE",
        "qwen3_5_moe",
        image_text=True,
        presets=("qwen3_5_moe", "qwen3_5_35b_a3b_random"),
    ),
)

# model_type (outer config.json, or the text model's own) -> the family's name.
SUPPORTED_FAMILIES: dict[str, str] = {
    model_type: family.name
    for family in TARGET_FAMILIES
    for model_type in (family.model_type, family.text_model_type)
}

# Image-text model types whose language model is what dflash loads.
IMAGE_TEXT_TYPES = {family.model_type for family in TARGET_FAMILIES if family.image_text}


def supported_list() -> str:
    return ", ".join(sorted(family.model_type for family in TARGET_FAMILIES))


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


def is_deltanet_layer(layer: nn.Module) -> bool:
    """A hybrid target's Gated DeltaNet decoder layer (Qwen3-Next, Qwen3.5 / Qwen3.6): its token
    mixer is `linear_attn` where a full-attention layer has `self_attn`."""
    return isinstance(getattr(layer, "linear_attn", None), nn.Module)
