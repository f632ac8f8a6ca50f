"""Files a real run starts from, built locally (dflash/tools/demo.py's tokenizer and conversation
files), with the tiny checkpoint of any family the tests use (tests/conftest.save_tiny_model)."""

from __future__ import annotations

from pathlib import Path

from dflash.tools.demo import build_tokenizer, write_conversations

__all__ = ["build_tokenizer", "save_tiny_target_with_tokenizer", "write_conversations"]


def save_tiny_target_with_tokenizer(directory: Path, model_type: str = "qwen3", **arch: int) -> Path:
    """tests/conftest.save_tiny_model's `model_type` (fields in `arch` replaced) plus the
    tokenizer: a complete local checkpoint."""
    from tests.conftest import save_tiny_model

    save_tiny_model(directory, model_type, **arch)
    build_tokenizer(directory)
    return directory
