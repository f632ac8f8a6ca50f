"""Shared fixtures: composing configs from conf/, a session-wide data cache, tiny saved targets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from dflash.tools.compose import compose_config as compose_dflash_config

# Limits for subprocesses and waits in tests: generous, since `make test` must pass on a 2-core
# machine that something else is loading too. They stop a hang; they time nothing.
SLOW_MACHINE_TIMEOUT_S = 1800

# Small enough for a test, large enough to fill every bucket and train a few steps.
FAST = ["data.num_samples=48", "eval.num_prompts=2", "eval.max_new_tokens=12", "monitor.interval_s=0"]


def compose_config(
    overrides: list[str] | None = None, output_dir: Path | None = None, cache_dir: Path | None = None
) -> DictConfig:
    overrides = list(overrides or [])
    if output_dir is not None:
        overrides.append(f"paths.output_dir={output_dir}")
    if cache_dir is not None:
        overrides.append(f"paths.cache_dir={cache_dir}")
    return compose_dflash_config(overrides)


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One synthetic-data cache for the whole session: each data config is generated once."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture
def make_cfg(tmp_path, data_cache):
    def _make(overrides: list[str] | None = None, output_dir: Path | None = None) -> DictConfig:
        return compose_config(FAST + list(overrides or []), output_dir or tmp_path / "run", data_cache)

    return _make


# The tiny target's architecture (conf/target/tiny.yaml uses the same numbers).
TINY_ARCH = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)


def save_tiny_model(directory: Path, model_type: str, **arch: int) -> Path:
    """A random-init model of a real architecture saved as a local checkpoint directory
    (`arch`: Qwen3 fields replacing TINY_ARCH's, e.g. a larger target for GPU benchmarks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = {k: v for k, v in TINY_ARCH.items() if k != "num_hidden_layers"}
    if model_type == "qwen3":
        config = AutoConfig.for_model("qwen3", **{**TINY_ARCH, **arch})
    elif model_type == "llama":  # tied embeddings, as SmolLM2 and Llama-3.2 1B/3B have
        config = AutoConfig.for_model("llama", **{**TINY_ARCH, "tie_word_embeddings": True, **arch})
    else:  # qwen3_next: hybrid Gated DeltaNet (linear attention) + full attention layers, MoE MLP
        config = AutoConfig.for_model(
            "qwen3_next",
            num_hidden_layers=6,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            full_attention_interval=2,
            **common,
        )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_next_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 checkpoint with a trained BPE tokenizer and a chat template beside it."""
    from tests.tiny_assets import save_tiny_target_with_tokenizer

    return save_tiny_target_with_tokenizer(tmp_path_factory.mktemp("qwen3_chat"))


@pytest.fixture(scope="session")
def tiny_conversations(tmp_path_factory) -> Path:
    from tests.tiny_assets import write_conversations

    return write_conversations(tmp_path_factory.mktemp("conversations") / "chat.jsonl", 40)


# Conversation data against the tiny chat target, sized for the tiny scheduler buckets.
def conversation_overrides(chat_dir: Path, files: list[Path]) -> list[str]:
    return [
        "data=conversations",
        f"data.files=[{','.join(str(f) for f in files)}]",
        "data.max_length=128",
        "data.min_supervised_tokens=4",
        f"target.path={chat_dir}",
    ]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
