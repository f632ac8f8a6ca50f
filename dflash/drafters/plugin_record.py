"""What a checkpoint of a plug-in's drafter variant records in its config.json, so that a process
without the plug-in refuses it in one line instead of reading it as plain DFlash.

A built-in variant's checkpoint is told apart by its own fields (`describes`: DSpark's heads,
DFlash2's selector), which every dflash knows. A plug-in's fields mean nothing to a process that
has not imported the plug-in: `drafter_class_for` falls back to the backbone, and the drafter
would decode, export, resume and report as DFlash without a word. So a variant named outside the
package adds `dflash_variant: {name, module}` to config.json, and a reader whose registry lacks
that name refuses the directory. Built-in variants record nothing: their exports stay byte for
byte what they were (tests/test_export_bytes.py).

The module is named for the user to enable (dflash/config/plugins.py), never imported from here:
a checkpoint does not get to run code.
"""

from __future__ import annotations

from typing import Any

from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.drafter_registry import registered_drafters

RECORD_KEY = "dflash_variant"
PACKAGE = "dflash"


def _naming_class(drafter_class: type[DFlashDrafter]) -> type[DFlashDrafter]:
    """The class that gave `drafter_class` its variant name (a subclass that only instruments a
    variant keeps its parent's name, and is that variant)."""
    return next(cls for cls in drafter_class.__mro__ if "variant_name" in vars(cls))


def variant_record(drafter_class: type[DFlashDrafter]) -> dict[str, Any]:
    """The config.json fields naming a plug-in's variant and the module defining it; {} for a
    variant of the package's own."""
    named_by = _naming_class(drafter_class)
    if named_by.__module__.partition(".")[0] == PACKAGE:
        return {}
    return {RECORD_KEY: {"name": named_by.variant_name, "module": named_by.__module__}}


def unregistered_variant(config: dict[str, Any]) -> str | None:
    """Why a config.json cannot be read here: the plug-in variant it records is not registered
    in this process (None: it records none, or a registered one)."""
    record = config.get(RECORD_KEY)
    if record is None:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        return f"{RECORD_KEY}={record!r}: not a drafter variant record ({{name, module}})"
    name, module = record["name"], record.get("module", "an unnamed module")
    if name in registered_drafters():
        return None
    return (
        f"drafter variant {name} (from module {module}) is not registered: install/enable the plug-in "
        f"(DFLASH_PLUGINS={module}, or the dflash.plugins entry point of its package)"
    )
