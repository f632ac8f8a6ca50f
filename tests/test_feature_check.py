"""The start-up feature check: broken context features are refused before the first step,
naming the layer, and every run records the figures (feature_check.json, run.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.run.launch import build_run
from dflash.target.feature_check import measure
from tests.conftest import SLOW_MACHINE_TIMEOUT_S, save_tiny_model


def broken_checkpoint(directory: Path, family: str, edit) -> Path:
    """A tiny checkpoint of `family` whose weights `edit(name, tensor)` rewrites."""
    save_tiny_model(directory, family)
    weights = load_file(str(directory / "model.safetensors"))
    save_file(
        {name: edit(name, tensor) for name, tensor in weights.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return directory


def zero_embeddings(name: str, tensor: torch.Tensor) -> torch.Tensor:
    # Bias-free layers over zero inputs stay zero: every hidden state of the target is 0, what a
    # capture that returns zeros hands the drafter.
    return torch.zeros_like(tensor) if "embed_tokens" in name else tensor


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_moe"])
def test_all_zero_features_are_refused_naming_the_layer_before_training(family, make_cfg, tmp_path):
    directory = broken_checkpoint(tmp_path / family, family, zero_embeddings)
    cfg = make_cfg(["target=hf", f"target.path={directory}"])
    with pytest.raises(
        ValueError, match=f"target.path={directory} on cpu: the target's features at layer 1 .* are all zero"
    ):
        build_run(cfg)
    report = json.loads((Path(cfg.paths.output_dir) / "feature_check.json").read_text())
    assert report["problems"] == ["layer 1: all zero", "layer 3: all zero"]


def test_non_finite_features_name_the_first_broken_layer(make_cfg, tmp_path):
    """NaN weights in decoder layer 2: layer 1's features are sound, layer 3's are not."""

    def nan_layer_2(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return torch.full_like(tensor, float("nan")) if "layers.2.mlp.down_proj" in name else tensor

    directory = broken_checkpoint(tmp_path / "nan", "qwen3", nan_layer_2)
    with pytest.raises(ValueError, match="features at layer 3 .* are [0-9]+ non-finite values"):
        build_run(make_cfg(["target=hf", f"target.path={directory}"]))


def test_features_the_same_at_every_position_or_of_absurd_size_are_problems():
    layer_ids = [1, 3]
    healthy = torch.randn(1, 8, 2 * 16)
    assert [s.problem() for s in measure(healthy, layer_ids)] == [None, None]
    constant = healthy.clone()
    constant[..., 16:] = torch.randn(16)  # layer 3: one vector broadcast over the positions
    problems = [s.problem() for s in measure(constant, layer_ids)]
    assert problems[0] is None and "the same vector at every position" in problems[1]
    huge = healthy * 1e6
    assert all("root-mean-square" in s.problem() for s in measure(huge, layer_ids))
    one_token = healthy[:, :1]  # one position: nothing to compare it with, not a problem
    assert [s.problem() for s in measure(one_token, layer_ids)] == [None, None]


def test_the_cli_refuses_in_one_line_and_run_json_keeps_the_figures(tmp_path, data_cache):
    directory = broken_checkpoint(tmp_path / "zero", "qwen3", zero_embeddings)
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.train",
            "target=hf",
            f"target.path={directory}",
            f"hydra.run.dir={run_dir}",
            f"paths.cache_dir={data_cache}",
            "data.num_samples=48",
        ],
        capture_output=True,
        text=True,
        timeout=SLOW_MACHINE_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "features at layer 1" in last and "all zero" in last
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "FAILED"
    assert [layer["layer"] for layer in record["feature_check"]["layers"]] == [1, 3]
