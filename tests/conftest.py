"""Shared fixtures: composing configs from conf/, a session-wide data cache, tiny saved targets."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from dflash.target.families import TARGET_FAMILIES
from dflash.tools.compose import compose_config as compose_dflash_config
from dflash.tools.demo import TINY_ARCH  # the tiny target's architecture, written once (tests import it here)

# Limits for subprocesses and waits in tests: generous, since `make test` must pass on a 2-core
# machine that something else is loading too. They stop a hang; they time nothing.
SLOW_MACHINE_TIMEOUT_S = 1800

# Small enough for a test, large enough to fill every bucket and train a few steps.
FAST = ["data.num_samples=48", "eval.num_prompts=2", "eval.max_new_tokens=12", "monitor.interval_s=0"]


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args...` as a user runs it, output captured, under the generous limit."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=SLOW_MACHINE_TIMEOUT_S
    )


def compose_config(
    overrides: list[str] | None = None, output_dir: Path | None = None, cache_dir: Path | None = None
) -> DictConfig:
    overrides = list(overrides or [])
    if output_dir is not None:
        overrides.append(f"paths.output_dir={output_dir}")
    if cache_dir is not None:
        overrides.append(f"paths.cache_dir={cache_dir}")
    return compose_dflash_config(overrides)


def yaml_leaves(node: dict, prefix: str = ""):
    """(dotted key, value) for every leaf of a config file's mapping: what the file sets."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from yaml_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One synthetic-data cache for the whole session: each data config is generated once."""
    return tmp_path_factory.mktemp("data_cache")


@pytest.fixture
def make_cfg(tmp_path, data_cache):
    def _make(overrides: list[str] | None = None, output_dir: Path | None = None) -> DictConfig:
        return compose_config(FAST + list(overrides or []), output_dir or tmp_path / "run", data_cache)

    return _make


# Hybrid stacks (Qwen3-Next, Qwen3.5): Gated DeltaNet (linear attention) layers with a full
# attention layer every second one here; MoE blocks with a shared expert.
TINY_LINEAR_ATTENTION = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_VISION = dict(  # Qwen3.5's vision tower, as small as it goes; dflash never loads it
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=1,
    temporal_patch_size=1,
)


def tiny_hybrid_arch(moe: bool = True) -> list[str]:
    """The arch keys of a published hybrid preset (MoE, or dense with `moe=False`), at sizes a
    CPU test builds in a second."""
    shape = {**TINY_ARCH, **TINY_LINEAR_ATTENTION, "full_attention_interval": 2}
    if moe:
        del shape["intermediate_size"]
        shape.update(TINY_MOE, shared_expert_intermediate_size=32)
    return [f"target.arch.{key}={value}" for key, value in shape.items()]


# Every family of the table (dflash/target/families.py), each with a tiny checkpoint below.
FAMILIES = [family.model_type for family in TARGET_FAMILIES]


def tiny_config(model_type: str, **arch: int):
    """A tiny transformers config of `model_type` in the published layout: for the image-text
    Qwen3.5 types, the text model under `text_config` beside a vision tower."""
    from transformers import AutoConfig

    common = {k: v for k, v in TINY_ARCH.items() if k != "num_hidden_layers"}
    hybrid_layers = ["linear_attention", "full_attention"] * 3
    if model_type == "qwen3":
        return AutoConfig.for_model("qwen3", **{**TINY_ARCH, **arch})
    if model_type == "llama":  # tied embeddings, as SmolLM2 and Llama-3.2 1B/3B have
        return AutoConfig.for_model("llama", **{**TINY_ARCH, "tie_word_embeddings": True, **arch})
    if model_type == "mistral":  # no sliding window, as Mistral-7B v0.3 and later publish
        return AutoConfig.for_model("mistral", **{**TINY_ARCH, "sliding_window": None, **arch})
    if model_type == "qwen2":
        return AutoConfig.for_model("qwen2", **{**TINY_ARCH, **arch})
    if model_type == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", **{**TINY_ARCH, **TINY_MOE, **arch})
    if model_type == "qwen3_next":
        return AutoConfig.for_model(
            "qwen3_next",
            num_hidden_layers=6,
            **TINY_LINEAR_ATTENTION,
            **TINY_MOE,
            shared_expert_intermediate_size=32,
            full_attention_interval=2,
            **common,
        )
    text = dict(common, num_hidden_layers=6, layer_types=hybrid_layers, **TINY_LINEAR_ATTENTION, **arch)
    if model_type == "qwen3_5_moe":
        text.update(TINY_MOE, shared_expert_intermediate_size=32)
    vision = dict(TINY_VISION, out_hidden_size=text["hidden_size"])
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision)


def save_tiny_model(directory: Path, model_type: str, **arch: int) -> Path:
    """A random-init model of a real architecture saved as its publisher lays out a checkpoint
    (`arch`: fields replacing TINY_ARCH's, e.g. a larger target for GPU benchmarks). Qwen3.5
    types are saved whole by their image-text class (`model.language_model.*`, `model.visual.*`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = tiny_config(model_type, **arch)
    torch.manual_seed(0)
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        model = AutoModelForImageTextToText.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


def tiny_checkpoint_fixture(family: str):
    """A session fixture: a tiny checkpoint of `family` saved once (save_tiny_model)."""

    @pytest.fixture(scope="session", name=f"tiny_{family}_dir")
    def checkpoint(tmp_path_factory) -> Path:
        return save_tiny_model(tmp_path_factory.mktemp(family), family)

    return checkpoint


# tiny_<model_type>_dir for every family (pytest finds fixtures among the module's names).
for _family in FAMILIES:
    globals()[f"tiny_{_family}_dir"] = tiny_checkpoint_fixture(_family)


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


# The suite gives the same result whatever the caller's shell holds: variables that change how
# the tools end or where they log are cleared for every test and the subprocesses they start (a
# test that needs one sets it itself). HYDRA_FULL_ERROR=1 adds tracebacks to one-line errors;
# WANDB_MODE=online would send runs to a server, and so would MLFLOW_TRACKING_URI=http://...
CALLER_VARIABLES = ("HYDRA_FULL_ERROR", "WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")


def pytest_configure(config):
    for name in CALLER_VARIABLES:
        os.environ.pop(name, None)
    # A caller's Hugging Face cache (unwritable, or holding other files) is not the suite's: its
    # own, empty and offline (nothing here downloads).
    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="dflash-tests-hf-")
    os.environ["HF_HUB_OFFLINE"] = "1"
    # MLflow's usage telemetry (sent to MLflow's servers) off: the suite reaches no network.
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def one_sample_batch():
    """A batch of one 8-token sample in bucket 0 (for metric sums that need only its plan)."""
    from dflash.data.collate import Batch
    from dflash.data.scheduler import PlannedBatch

    return Batch(
        torch.zeros(1, 8, dtype=torch.int64),
        torch.ones(1, 8, dtype=torch.uint8),
        torch.tensor([8]),
        PlannedBatch(epoch=0, index=0, bucket=0, sample_ids=(0,)),
    )


def record_wandb_rows(run, monkeypatch) -> list[dict]:
    """Every row a built run's (offline) W&B sink sends, recorded as it is passed on to W&B."""
    from dflash.monitor.sinks import BackgroundSink

    wandb_run = next(s for s in run.trainer.monitor.sinks if isinstance(s, BackgroundSink)).sink.run
    sent: list[dict] = []
    real_log = wandb_run.log
    monkeypatch.setattr(
        wandb_run, "log", lambda data, step=None: (sent.append(dict(data)), real_log(data, step=step))
    )
    return sent


class VariantRegistries:
    """Every registry a drafter variant enters (its drafter class, training side, options, export
    rules and Hydra's `variant` group), copied for one test: what the test registers (a plug-in
    it loads) is gone afterwards, so the tests that iterate every registered variant see the
    package's and the test modules' own, whatever ran before them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        from hydra.core.config_store import ConfigStore

        from dflash.config.schema import COMPONENT_OPTIONS
        from dflash.drafters import drafter_registry as variants
        from dflash.export import export_registry as exports
        from dflash.step import variant_registry

        self._monkeypatch = monkeypatch
        self._entries = [
            (variants, "_DRAFTERS", dict(variants._DRAFTERS)),
            (variant_registry, "_VARIANTS", dict(variant_registry._VARIANTS)),
            (exports, "_EXPORTS", dict(exports._EXPORTS)),
        ]
        self._items = [
            (COMPONENT_OPTIONS, "variant", dict(COMPONENT_OPTIONS["variant"])),
            (ConfigStore.instance().repo, "variant", dict(ConfigStore.instance().repo.get("variant", {}))),
        ]
        self.forget()

    def forget(self, *modules: str) -> None:
        """Back to the registries as the test found them, and `modules` unimported: a process
        that never loaded the plug-ins (loading them again registers them anew)."""
        for module, name, saved in self._entries:
            self._monkeypatch.setattr(module, name, dict(saved))
        for mapping, key, saved in self._items:
            self._monkeypatch.setitem(mapping, key, dict(saved))
        for module in modules:  # not monkeypatched: undone, it would come back, registering nothing
            sys.modules.pop(module, None)


@pytest.fixture
def variant_registries(monkeypatch) -> VariantRegistries:
    return VariantRegistries(monkeypatch)
