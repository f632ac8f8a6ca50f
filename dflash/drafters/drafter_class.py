"""Which drafter class a config describes (a checkpoint's config.json, or a run's)."""

from __future__ import annotations

from transformers import Qwen3Config

from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.drafter_registry import drafter_class_for


def drafter_from_config(config: Qwen3Config) -> DFlashDrafter:
    """The registered variant's drafter whose fields the config carries (DSpark: `markov_rank`;
    DFlash2: the selector in its dflash_config), else DFlash."""
    return drafter_class_for(config)(config)
