"""`dflash-export check`: every export dflash writes keeps the contract of docs/EXPORT.md, and
each broken case a serving reader would misread is named, one line each, exit 2."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.export.contract import check_export
from dflash.export.zlab import export_drafter
from dflash.train import train
from tests.conftest import run_module
from tests.test_dflash_rules import tiny_drafter, tiny_target

TINY_TARGET = {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 512}


@pytest.fixture
def export(tmp_path) -> Path:
    export_drafter(tiny_drafter(tiny_target()), tmp_path / "drafter")
    return tmp_path / "drafter"


def edit_config(directory: Path, edit) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def edit_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path))


def test_an_export_and_a_training_checkpoint_keep_the_contract(export, make_cfg, tiny_llama_dir):
    assert check_export(export, target=TINY_TARGET) == []
    summary = train(make_cfg(["target=hf", f"target.path={tiny_llama_dir}", "train.total_steps=2"]))
    assert check_export(Path(summary["checkpoint"]), target=TINY_TARGET) == []


def renamed(weights: dict) -> dict:
    weights["fc.proj.weight"] = weights.pop("fc.weight")
    return weights


def wrong_fc(weights: dict) -> dict:
    weights["fc.weight"] = torch.zeros(64, 3 * 64)  # three features' width, the config says two
    return weights


@pytest.mark.parametrize(
    "weights_edit,expected",
    [
        (
            renamed,
            [
                "tensor fc.weight is missing",
                "unexpected tensor fc.proj.weight (SGLang would skip it silently",
            ],
        ),
        (wrong_fc, ["tensor fc.weight has shape [64, 192], the config needs [64, 128]"]),
        (
            lambda w: {**w, "embed_tokens.weight": torch.zeros(512, 64)},
            ["unexpected tensor embed_tokens.weight"],
        ),
        (
            lambda w: {k: v.half() if k == "norm.weight" else v for k, v in w.items()},
            ["mixed tensor dtypes"],
        ),
    ],
    ids=["renamed_tensor", "wrong_fc_shape", "embedding_bundled", "mixed_dtypes"],
)
def test_broken_weights_are_named(export, weights_edit, expected):
    edit_weights(export, weights_edit)
    problems = check_export(export)
    for text in expected:
        assert any(text in p for p in problems), problems


@pytest.mark.parametrize(
    "config_edit,expected",
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id is None"),
        (lambda c: c.pop("rope_theta"), "rope_theta is missing: transformers 4.57"),
        (
            lambda c: c.update(num_target_layers=3),
            "target_layer_ids [1, 3] are not all inside the target's 3 layers",
        ),
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "not ['DFlashDraftModel']"),
        (
            lambda c: c["dflash_config"].update(mask_token_id=600),
            "mask_token_id 600 is outside the vocabulary (512)",
        ),
        (
            lambda c: c.update(layer_types=["sliding_attention", "full_attention"]),
            "sliding layers need a positive sliding_window",
        ),
        (lambda c: c.pop("block_size"), "block_size is None"),
    ],
    ids=[
        "no_mask_id",
        "no_rope_theta",
        "layer_id_past_depth",
        "architecture",
        "mask_outside_vocab",
        "window",
        "block",
    ],
)
def test_broken_configs_are_named(export, config_edit, expected):
    edit_config(export, config_edit)
    problems = check_export(export)
    assert any(expected in p for p in problems), problems
    assert all(p.startswith(str(export)) for p in problems)


def test_every_problem_of_a_config_is_named_at_once(export):
    def two_mistakes(config):
        config["architectures"] = ["Qwen3ForCausalLM"]
        config["dflash_config"]["mask_token_id"] = 600

    edit_config(export, two_mistakes)
    problems = check_export(export)
    assert any("not ['DFlashDraftModel']" in p for p in problems)
    assert any("mask_token_id 600 is outside the vocabulary" in p for p in problems)


def test_the_target_pairing_is_checked(export):
    problems = check_export(export, target={"num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 500})
    assert any("num_target_layers 6 but the target has 8 layers" in p for p in problems)
    assert any("mask_token_id 511 is outside the target's vocabulary (500)" in p for p in problems)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("dflash.tools.export", *args)


def test_the_cli_prints_one_line_per_problem_and_exits_2(export, tiny_qwen3_5_dir):
    ok = run_cli("check", str(export))
    assert ok.returncode == 0 and ok.stdout.startswith("ok: ")
    edit_weights(export, wrong_fc)
    edit_config(export, lambda c: c.pop("rope_theta"))
    broken = run_cli(
        "check", str(export), "--target", str(tiny_qwen3_5_dir)
    )  # an image-text target: its text_config
    assert broken.returncode == 2
    lines = broken.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("dflash-export: ") for line in lines)
