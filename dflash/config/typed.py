"""The composed config, converted once to its typed form."""

from __future__ import annotations

import math
import os

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue
from omegaconf.nodes import FloatNode

from dflash.config.schema import Config


def typed_config(cfg: DictConfig) -> Config:
    """The composed config as its schema dataclass: resolved, every node a dataclass, every kind
    an enum member. Entry points convert once and pass the result on; nothing downstream reads
    a DictConfig or re-wraps an enum."""
    expand_home(cfg)
    try:
        refuse_non_finite(cfg)
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        key = exc.full_key
        raise ValueError(f"{key} has no value ('???' in its config group): set it, e.g. {key}=...") from exc


def refuse_non_finite(node: DictConfig | ListConfig, prefix: str = "") -> None:
    """ValueError naming the first float setting (a schema field typed float, or a list of them)
    that is nan or +-inf. Hydra reads `nan` and `inf` as floats, and no dflash setting means
    either: a nan loss weight or LR trains a few steps and then fails on a non-finite loss,
    blaming the LR. Checked here, once for every field, before any single-field rule (`x < 0`
    is false for nan). Free-form entries (target.arch, callbacks' arguments) are left to their
    readers."""
    in_list = isinstance(node, ListConfig)
    for key in range(len(node)) if in_list else node.keys():
        path = f"{prefix}[{key}]" if in_list else f"{prefix}.{key}".lstrip(".")
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)):
            if not (child._is_none() or child._is_missing()):
                refuse_non_finite(child, path)
        elif isinstance(child, FloatNode) and not child._is_missing():
            value = node[key]  # resolved (an interpolation reads its source)
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{path}={value}: must be a finite number")


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
