"""The composed config, converted once to its typed form."""

from __future__ import annotations

import os

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from dflash.config.schema import Config


def typed_config(cfg: DictConfig) -> Config:
    """The composed config as its schema dataclass: resolved, every node a dataclass, every kind
    an enum member. Entry points convert once and pass the result on; nothing downstream reads
    a DictConfig or re-wraps an enum."""
    expand_home(cfg)
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        key = exc.full_key
        raise ValueError(f"{key} has no value ('???' in its config group): set it, e.g. {key}=...") from exc


def expand_home(cfg: DictConfig) -> None:
    """Every value that starts with `~` (a path: paths.output_dir, data.files, target.path,
    resume, ...) expanded to the home directory in place, as a shell would have: left as is,
    `~/runs` would name a directory called `~` under the working directory."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except InterpolationResolutionError as exc:
        # OmegaConf's message: "<Error> raised while resolving interpolation: <text>", then the
        # node's details on further lines; the text names the key already where dflash raised.
        text = str(exc).splitlines()[0].split("raised while resolving interpolation: ", 1)[-1]
        raise ValueError(text if text.startswith(f"{exc.full_key}:") else f"{exc.full_key}: {text}") from exc

    def walk(node, value) -> None:
        items = enumerate(value) if isinstance(value, list) else value.items()
        for key, child in items:
            if isinstance(child, (dict, list)):
                walk(node[key], child)
            elif isinstance(child, str) and child.startswith("~"):
                node[key] = os.path.expanduser(child)

    if isinstance(cfg, (DictConfig, ListConfig)):
        walk(cfg, resolved)
