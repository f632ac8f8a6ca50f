"""Which drafter class a config describes (a checkpoint's config.json, or a run's)."""

from __future__ import annotations

from transformers import Qwen3Config

from dflash.models.dflash2 import DFlash2Drafter, is_dflash2_config
from dflash.models.drafter import DFlashDrafter
from dflash.models.dspark import DSparkDrafter, is_dspark_config


def drafter_from_config(config: Qwen3Config) -> DFlashDrafter:
    """DSpark when the config carries `markov_rank`, DFlash2 when its dflash_config sets the
    selector, else DFlash."""
    if is_dspark_config(config):
        return DSparkDrafter(config)
    if is_dflash2_config(config):
        return DFlash2Drafter(config)
    return DFlashDrafter(config)
