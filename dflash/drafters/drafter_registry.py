"""The drafter variants, registered once: each variant's drafter class under its name
(`variant_name`). Everything past the training step finds a drafter's variant here or on the
drafter object itself (`DFlashDrafter`'s interface: what it drafts, how it verifies, which
layout it exports, which config fields it adds), never by testing a class or a name.

A variant of one's own registers its drafter class with `register_drafter` (next to
`COMPONENT_OPTIONS` for its training side); the registry refuses a second class under a taken
name, and can be iterated, so one test runs every entry through every stage.
"""

from __future__ import annotations

from typing import Any

from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.dflash2 import DFlash2Drafter
from dflash.drafters.dspark import DSparkDrafter
from dflash.drafters.lilicorr import LiLiCorrDrafter

_DRAFTERS: dict[str, type[DFlashDrafter]] = {}


def register_drafter(drafter_class: type[DFlashDrafter]) -> type[DFlashDrafter]:
    """Register a drafter class under its `variant_name` (usable as a class decorator)."""
    name = drafter_class.variant_name
    taken = _DRAFTERS.get(name)
    if taken is not None and taken is not drafter_class:
        raise ValueError(f"drafter variant {name!r} is registered already ({taken.__qualname__})")
    _DRAFTERS[name] = drafter_class
    return drafter_class


def registered_drafters() -> dict[str, type[DFlashDrafter]]:
    """Every registered drafter class by variant name, the backbone first."""
    return dict(_DRAFTERS)


def drafter_class_for(config: Any) -> type[DFlashDrafter]:
    """The class a drafter config describes: the registered variant whose fields it carries
    (`describes`), else the DFlash backbone."""
    for drafter_class in _DRAFTERS.values():
        if drafter_class is not DFlashDrafter and drafter_class.describes(config):
            return drafter_class
    return DFlashDrafter


def extends_backbone(config: Any) -> bool:
    """Whether a config describes a variant that adds parts to the DFlash backbone."""
    return drafter_class_for(config) is not DFlashDrafter


for _drafter_class in (DFlashDrafter, DSparkDrafter, DFlash2Drafter, LiLiCorrDrafter):
    register_drafter(_drafter_class)
