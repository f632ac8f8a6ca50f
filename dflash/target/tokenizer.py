"""The target's tokenizer (and chat template), from `target.tokenizer` or `target.path`."""

from __future__ import annotations

from typing import Any

from dflash.config.schema import TargetConfig
from dflash.target.model_dirs import refuse_missing_model_dir


def load_tokenizer(cfg: TargetConfig, needed_for: str) -> Any:
    directory = cfg.tokenizer or cfg.path
    if directory is None:
        raise ValueError(
            f"{needed_for} needs the target's tokenizer: set target.tokenizer (or target.path) "
            f"to a directory with tokenizer files (target={cfg.name} has neither)"
        )
    from transformers import AutoTokenizer

    key = "target.tokenizer" if cfg.tokenizer else "target.path"
    refuse_missing_model_dir(key, directory)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key}={directory!r}: cannot load a tokenizer there ({exc})") from exc
