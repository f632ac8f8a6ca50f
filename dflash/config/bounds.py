"""The bound check the config schemas share, so every such refusal reads the same way.

No torch here: see dflash/config/schema.py."""

from __future__ import annotations


def at_least(key: str, value: float, minimum: float) -> None:
    """Refuse `key` (dotted) set below `minimum`: `KEY must be >= MINIMUM, got VALUE`. `not >=`:
    nan, which compares false both ways, is refused too."""
    if not value >= minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
