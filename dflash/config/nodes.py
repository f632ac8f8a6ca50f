"""Typed views of a composed config's nodes."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf


def node(cfg: DictConfig, key: str) -> Any:
    """A config node as its schema dataclass (resolved, typed)."""
    return OmegaConf.to_object(cfg[key])
