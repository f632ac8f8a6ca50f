"""Compose the dflash config outside a Hydra app (for command-line tools and scripts)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"


def compose_config(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """The config `dflash-train <overrides>` would run; with `hydra` (choices, launcher) on request."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=return_hydra_config)
