"""The drafter variants, registered once: each variant's drafter class under its name
(`variant_name`). Everything past the training step finds a drafter's variant here or on the
drafter object itself (`DFlashDrafter`'s interface: what it drafts, how it verifies, which
layout it exports, which config fields it adds), never by testing a class or a name.

The built-in variants' drafter classes are entered from the package's one list of them
(dflash/config/variant_schema.py BUILT_IN_VARIANTS), each by its import path in this floor; this
module names none. A variant of one's own registers its drafter class with `register_drafter`
(`register_variant`, dflash/step/variant_registry.py, does it with its training side); the
registry refuses a second class under a taken name, and can be iterated, so one test runs every
entry through every stage.
"""

from __future__ import annotations

from typing import Any

from dflash.config.variant_schema import BUILT_IN_VARIANTS, built_in_piece
from dflash.drafters.backbone import DFlashDrafter

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


for _variant in BUILT_IN_VARIANTS:
    register_drafter(built_in_piece(_variant.drafter, floor="dflash.drafters"))
