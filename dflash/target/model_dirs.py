"""Config values that name a model to load (`target.path`, `target.tokenizer`): a local directory,
which must exist, or a Hugging Face hub id, which transformers looks up in its cache or on the hub.

The rule: a value that exists on disk is a local path (a directory: a file is refused); one
that does not is refused at once unless it is written as a hub id, `name` or `namespace/name`
(letters, digits, `-`, `_`, `.`; no leading `/`, `.` or `~`, at most one `/`). transformers
reads every other string as a hub id too and fails, after torch and transformers have loaded,
with "Repo id must be in the form ...", which never says that the directory does not exist.
Nothing heavy is imported here: dflash-train calls this before it imports torch's and
transformers' model code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash.target.gguf import gguf_file, is_gguf

# huggingface_hub.utils.validate_repo_id's form (it also refuses "--", ".." and over 96 characters).
_HUB_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")
_HUB_ID_LENGTH = 96


def is_hub_id(value: str) -> bool:
    return (
        bool(_HUB_ID.fullmatch(value))
        and "--" not in value
        and ".." not in value
        and len(value) <= _HUB_ID_LENGTH
    )


def refuse_missing_model_dir(key: str, value: str | None) -> None:
    """`key=value` refused in one line where `value` is a local path that does not exist (the
    module's rule) or is a file; a hub id, an existing directory and an unset key pass."""
    if value is None:
        return
    local = Path(os.path.expanduser(value))
    if local.exists() and not local.is_dir():
        raise ValueError(
            f"{key}={value}: a file, not a checkpoint directory (the directory that holds config.json)"
        )
    if local.exists() or is_hub_id(value):
        return
    raise ValueError(
        f"{key}={value}: no such directory (a local checkpoint directory must exist; a Hugging Face "
        "hub id is written namespace/name)"
    )


def refuse_missing_target_dirs(cfg: DictConfig) -> None:
    """A composed config's `target.path` (a GGUF file or `package:<name>` is checked as
    dflash/target/gguf.py reads it) and `target.tokenizer`, before any model code is imported."""
    path = OmegaConf.select(cfg, "target.path", default=None)
    if is_gguf(path):
        gguf_file(os.path.expanduser(path))
    else:
        refuse_missing_model_dir("target.path", path)
    refuse_missing_model_dir("target.tokenizer", OmegaConf.select(cfg, "target.tokenizer", default=None))
