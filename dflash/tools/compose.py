"""Compose the dflash config outside a Hydra app (for command-line tools and scripts)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

if TYPE_CHECKING:
    from dflash.config.schema import Config

# The YAML configs are package data: the repository's top-level conf/ is the package `dflash.conf`
# (dflash/conf links to it; a wheel carries the files themselves), so every command finds them
# through the installed package, in a checkout or not.
CONF_MODULE = "dflash.conf"
CONF_PATH = f"pkg://{CONF_MODULE}"  # what hydra.main(config_path=...) takes


def conf_dir() -> Path:
    """The directory of the installed configs (to list a group's options)."""
    import importlib

    return Path(importlib.import_module(CONF_MODULE).__file__).parent


CONF_DIR = conf_dir()


def compose_config(
    overrides: list[str], return_hydra_config: bool = False, *, config_name: str = "config"
) -> DictConfig:
    """The config `dflash train <overrides>` would run (`config_name="regen"`: `dflash regen`);
    with `hydra` (choices, launcher) on request."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from dflash.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONF_MODULE, version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=return_hydra_config)


def compose_typed(overrides: list[str]) -> Config:
    """`compose_config` converted to its typed form, for tools and scripts that write no run
    directory: outside a Hydra app `paths.output_dir` (Hydra's run dir) has no value, so unless
    the overrides set it, it names a scratch directory nothing is written to."""
    from dflash.config.typed import typed_config

    if not any(o.split("=", 1)[0].lstrip("+") == "paths.output_dir" for o in overrides):
        overrides = [*overrides, f"paths.output_dir={Path(tempfile.gettempdir()) / 'dflash-tool'}"]
    return typed_config(compose_config(overrides))


def with_defaults(defaults: list[str], overrides: list[str]) -> list[str]:
    """A script's default overrides (`key=value`) whose key the user's overrides do not set,
    then the user's: the benchmarks' defaults without shadowing what the command line asks."""
    given = {override.split("=", 1)[0] for override in overrides}
    return [d for d in defaults if d.split("=", 1)[0] not in given] + overrides


def device_default() -> str:
    """The `gpu` option a benchmark runs on by default: one GPU where CUDA is (the run config's
    own default is the CPU), else the CPU."""
    import torch

    return "gpu=single" if torch.cuda.is_available() else "gpu=cpu"
