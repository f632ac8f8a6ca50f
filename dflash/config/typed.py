"""The composed config, converted once to its typed form."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from dflash.config.schema import Config


def typed_config(cfg: DictConfig) -> Config:
    """The composed config as its schema dataclass: resolved, every node a dataclass, every kind
    an enum member. Entry points convert once and pass the result on; nothing downstream reads
    a DictConfig or re-wraps an enum."""
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        key = exc.full_key
        raise ValueError(f"{key} has no value ('???' in its config group): set it, e.g. {key}=...") from exc
