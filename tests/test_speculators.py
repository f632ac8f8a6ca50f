"""The speculators layout: a drafter trained elsewhere in it loads here (fine-tuning, eval), one
trained here converts to it and back, and the layout's own rules are checked as its readers
apply them (aux ids are decoder layer + 1: vLLM's reader subtracts one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from dflash.config.schema import DrafterConfig
from dflash.drafters.backbone import DFlashDrafter, drafter_config
from dflash.export.contract import check_export
from dflash.export.zlab import export_drafter, load_drafter, read_drafter_config
from dflash.run.resume import check_resume_matches
from dflash.tools.export import main as export_main
from tests.conftest import TINY_ARCH

LAYER_IDS = [1, 3]


def export_cli(capsys, *args: str) -> tuple[int, str]:
    """`dflash export ARGS` in this process: (exit code, stderr)."""
    try:
        export_main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def tiny_drafter(**fields) -> DFlashDrafter:
    target = AutoConfig.for_model("qwen3", **TINY_ARCH)
    cfg = DrafterConfig(name="t", num_layers=2, block_size=4, mask_token_id=511, **fields)
    torch.manual_seed(3)
    return DFlashDrafter(drafter_config(cfg, target, LAYER_IDS))


def write_as_speculators_does(directory: Path, drafter: DFlashDrafter, *, bundle: bool = True) -> Path:
    """A drafter directory laid out as the speculators library saves a DFlash drafter: the Qwen3
    layer config nested, the DFlash fields on top, aux ids counted from the embedding output,
    the target's embedding and LM head bundled (a self-contained drafter)."""
    directory.mkdir(parents=True)
    layer = {k: v for k, v in drafter.config.to_dict().items() if k not in ("dflash_config", "block_size", "num_target_layers", "architectures")}  # fmt: skip
    config = {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashDraftModel"],
        "speculators_version": "0.5.0",
        "transformer_layer_config": layer,
        "block_size": 4,
        "mask_token_id": 511,
        "aux_hidden_state_layer_ids": [i + 1 for i in LAYER_IDS],
        "draft_vocab_size": TINY_ARCH["vocab_size"],
        "target_hidden_size": None,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "tiny/qwen3", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    (directory / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in drafter.state_dict().items() if not k.startswith("rotary")}
    if bundle:
        shape = (TINY_ARCH["vocab_size"], TINY_ARCH["hidden_size"])
        state["embed_tokens.weight"] = torch.randn(shape)
        state["lm_head.weight"] = torch.randn(shape)
    save_file(state, str(directory / "model.safetensors"))
    return directory


def test_a_speculators_drafter_loads_as_the_same_drafter(tmp_path):
    ours = tiny_drafter()
    directory = write_as_speculators_does(tmp_path / "spec", ours)
    assert check_export(directory) == []
    loaded = load_drafter(directory)
    assert loaded.target_layer_ids == LAYER_IDS and loaded.mask_token_id == 511 and loaded.block_size == 4
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    # drafter.init_from's check: the same drafter for the same target, though the layout
    # records no target depth.
    check_resume_matches(directory, ours.config, {}, key="drafter.init_from")


def test_a_speculators_drafter_for_other_layers_is_refused_for_init(tmp_path):
    directory = write_as_speculators_does(tmp_path / "spec", tiny_drafter())
    config = json.loads((directory / "config.json").read_text())
    config["aux_hidden_state_layer_ids"] = LAYER_IDS  # the z-lab ids written unshifted: layers 0 and 2
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"drafter.target_layer_ids: checkpoint \[0, 2\], this run \[1, 3\]"):
        check_resume_matches(directory, tiny_drafter().config, {}, key="drafter.init_from")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"speculators_model_type": "eagle3"}, "is not 'dflash'"),
        ({"aux_hidden_state_layer_ids": [0, 2]}, "0 is the embedding output"),
        ({"draft_vocab_size": 256}, "reduced draft vocabulary"),
        ({"mask_token_id": None}, "mask_token_id is missing"),
    ],
)
def test_speculators_configs_dflash_cannot_serve_are_refused(tmp_path, change, message):
    directory = write_as_speculators_does(tmp_path / "spec", tiny_drafter())
    config = {**json.loads((directory / "config.json").read_text()), **change}
    (directory / "config.json").write_text(json.dumps(config))
    assert any(message in problem for problem in check_export(directory))
    with pytest.raises(ValueError, match=message):
        read_drafter_config(directory)


def test_a_vocabulary_map_is_refused_by_name(tmp_path):
    directory = write_as_speculators_does(tmp_path / "spec", tiny_drafter())
    state = load_file(str(directory / "model.safetensors"))
    state["d2t"] = torch.zeros(16, dtype=torch.int64)
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds \['d2t'\], a reduced draft vocabulary"):
        load_drafter(directory)


def test_convert_to_speculators_and_back_keeps_the_drafter(tmp_path, tiny_qwen3_dir, capsys):
    """dflash export convert: z-lab -> speculators (self-contained, the target's own tables
    bundled) -> z-lab gives back the export tensor for tensor; every step passes the check."""
    drafter = tiny_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    export_drafter(drafter, tmp_path / "zlab")
    spec, back = tmp_path / "spec", tmp_path / "back"
    code, err = export_cli(
        capsys,
        "convert",
        str(tmp_path / "zlab"),
        str(spec),
        "--layout",
        "speculators",
        "--target",
        str(tiny_qwen3_dir),
    )
    assert code == 0, err
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in LAYER_IDS]
    # vLLM's speculators reader: target_layer_ids = aux - 1.
    assert [i - 1 for i in config["aux_hidden_state_layer_ids"]] == drafter.target_layer_ids
    assert config["sliding_window_non_causal"] is True
    assert config["transformer_layer_config"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(tiny_qwen3_dir)
    target = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    with safe_open(str(spec / "model.safetensors"), "pt") as handle:
        torch.testing.assert_close(handle.get_tensor("lm_head.weight"), target["lm_head.weight"].float())
        torch.testing.assert_close(handle.get_tensor("embed_tokens.weight"), target["model.embed_tokens.weight"].float())  # fmt: skip

    code, err = export_cli(capsys, "convert", str(spec), str(back), "--layout", "zlab")
    assert code == 2 and "records no target depth" in err  # SGLang needs it
    code, err = export_cli(
        capsys, "convert", str(spec), str(back), "--layout", "zlab", "--target", str(tiny_qwen3_dir)
    )
    assert code == 0, err
    original, returned = load_file(str(tmp_path / "zlab" / "model.safetensors")), load_file(str(back / "model.safetensors"))  # fmt: skip
    assert original.keys() == returned.keys()
    for name in original:
        assert torch.equal(original[name], returned[name]), name
    loaded = load_drafter(back)
    assert loaded.layer_windows == [8, None] and loaded.target_layer_ids == LAYER_IDS


def test_convert_needs_the_target_and_an_empty_destination(tmp_path, capsys):
    """speculators' loader reads the target's tables from the drafter directory (its own
    save_pretrained writes them), so the layout is written with them or not at all."""
    export_drafter(tiny_drafter(), tmp_path / "zlab")
    code, err = export_cli(
        capsys,
        "convert",
        str(tmp_path / "zlab"),
        str(tmp_path / "spec"),
        "--layout",
        "speculators",
        "--verifier",
        "t",
    )
    assert code == 2 and err == (
        "dflash export: error: --layout speculators needs --target DIR: speculators' loader reads the "
        "target's embedding and LM head from the drafter directory (its own save_pretrained writes both)\n"
    )
    assert not (tmp_path / "spec").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code, err = export_cli(
        capsys, "convert", str(tmp_path / "zlab"), str(tmp_path / "full"), "--layout", "zlab"
    )
    assert code == 2 and "not empty" in err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
