"""Export in the z-lab / SGLang / vLLM layout and load back from config.json + safetensors alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash.export.zlab import export_drafter, load_drafter
from dflash.step.blocks import block_attention_mask
from tests.test_dflash_rules import blocks_for, tiny_drafter, tiny_target


def test_export_layout(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    export_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4 and config["num_target_layers"] == 6
    assert config["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1, 3]}
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == set(drafter.state_dict())
    assert all(k.startswith(("layers.", "fc.", "hidden_norm.", "norm.")) for k in keys)


def test_round_trip_gives_identical_outputs(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the init: the weights must really load
    export_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path)
    ids = torch.randint(0, 500, (2, 16))
    blocks = blocks_for(ids, torch.ones(2, 16))
    mask = block_attention_mask(blocks.anchors, blocks.anchor_valid, 16, 4)
    args = (target.features(ids), target.embed_tokens(blocks.block_ids), blocks.positions, mask)
    assert torch.equal(drafter(*args), loaded(*args))
    assert loaded.mask_token_id == 511 and loaded.target_layer_ids == [1, 3] and loaded.block_size == 4


def test_corrupt_export_is_refused_with_the_path(tmp_path):
    drafter = tiny_drafter(tiny_target())
    export_drafter(drafter, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json"):
        load_drafter(tmp_path)


def test_exported_weights_are_as_readable_as_the_rest_of_the_checkpoint(tmp_path):
    import os

    old_umask = os.umask(0o022)
    try:
        export_drafter(tiny_drafter(tiny_target()), tmp_path)
    finally:
        os.umask(old_umask)
    config_mode = (tmp_path / "config.json").stat().st_mode & 0o777
    assert config_mode == 0o644
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == config_mode  # not 0600
