"""A LiLiCorr drafter's export (dflash/export/lilicorr_rules.py): the z-lab layout SGLang's and vLLM's
LiLiCorr loaders read (`architectures: [LiLiCorrDraftModel]`, the `lilicorr_*` geometry in
dflash_config, the `lilicorr.*` tensors), checked by the export contract; the drafter's tensors
written under its own names bit for bit and loaded back to them; a broken geometry named
one line each; every other layout refused in one line with exit code 2."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash.drafters.lilicorr import LiLiCorrDrafter
from dflash.export.contract import check_export
from dflash.export.export_registry import export_for_config
from dflash.export.lilicorr_rules import LiLiCorrExport
from dflash.export.zlab import export_drafter, load_drafter
from dflash.tools.export import main as export_main
from tests.test_dflash2_export import TINY_TARGET
from tests.test_dflash_rules import tiny_target
from tests.test_export_contract import edit_config
from tests.test_lilicorr import tiny_lilicorr


def off_init(drafter: LiLiCorrDrafter) -> LiLiCorrDrafter:
    """Every weight moved off its init, as training moves it: a tensor written or read back
    from anywhere but the drafter shows."""
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return drafter


def assert_same_tensors(directory, drafter: LiLiCorrDrafter) -> None:
    """The export holds the drafter's tensors under the drafter's own names (the served readers'
    names: `state_dict()` is the export as is), bit for bit, and loads back to them."""
    state = drafter.state_dict()
    written = load_file(str(directory / "model.safetensors"))
    assert sorted(written) == sorted(state)
    assert [name for name in state if not torch.equal(written[name], state[name])] == []
    loaded = load_drafter(directory)
    assert isinstance(loaded, LiLiCorrDrafter)
    back = loaded.state_dict()
    assert sorted(back) == sorted(state)
    assert [name for name in state if not torch.equal(back[name], state[name])] == []


@pytest.fixture
def trained() -> LiLiCorrDrafter:
    return off_init(tiny_lilicorr(tiny_target()))


@pytest.fixture
def export(tmp_path, trained):
    directory = tmp_path / "lilicorr"
    export_drafter(trained, directory)
    return directory


def test_the_convolutions_export_under_dflash2s_names_and_keep_the_contract(tmp_path):
    from tests.test_lilicorr import lilicorr_config

    target = tiny_target()
    config = lilicorr_config(target, conv_kernel_size=2, conv_group_size=16)
    drafter = off_init(LiLiCorrDrafter(config))
    export_drafter(drafter, tmp_path / "conv")
    assert check_export(tmp_path / "conv", target=TINY_TARGET) == []
    assert_same_tensors(tmp_path / "conv", drafter)
    assert drafter.layers[0].attention_conv.base_kernel.shape == (2, 2, 64)
    assert {"layers.1.mlp_conv.base_kernel", "layers.1.attention_conv.kernel_projection.weight"} <= set(
        drafter.state_dict()
    )  # DFlash2's names
    written = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert written["dflash_config"]["conv_group_size"] == 16
    # DFlash2's rules recognise its convolution keys too; the drafter it loads as decides.
    assert isinstance(export_for_config(written), LiLiCorrExport)


def test_the_export_is_the_layout_the_served_loaders_read(export, trained):
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LiLiCorrDraftModel"]
    assert config["dflash_config"]["lilicorr_enabled"] is True
    assert {
        key: config["dflash_config"][f"lilicorr_{key}"]
        for key in ("candidate_topk", "num_layers", "factor_dim")
    } == {
        "candidate_topk": 4,
        "num_layers": 1,
        "factor_dim": 8,
    }
    assert check_export(export, target=TINY_TARGET) == []
    assert_same_tensors(export, trained)
    assert "lilicorr.layers.0.attn.in_proj_weight" in trained.state_dict()  # nn.MultiheadAttention's name


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda c: c["dflash_config"].update(lilicorr_candidate_topk=3),
            "lilicorr_candidate_topk=3: must be a power of two",
        ),
        (
            lambda c: c["dflash_config"].pop("lilicorr_logit_scale"),
            "needs dflash_config.lilicorr_logit_scale",
        ),
        (lambda c: c.update(architectures=["DFlashDraftModel"]), "not ['LiLiCorrDraftModel']"),
    ],
)
def test_a_broken_lilicorr_export_is_named_one_line_each(export, capsys, edit, expected):
    edit_config(export, edit)
    with pytest.raises(SystemExit) as stopped:
        export_main(["check", str(export)])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert any(expected in line for line in lines), lines


@pytest.mark.parametrize("layout", ["speculators", "deepspec"])
def test_layouts_no_reader_loads_it_in_are_refused_in_one_line(
    export, tmp_path, tiny_qwen3_dir, capsys, layout
):
    destination = tmp_path / layout
    with pytest.raises(SystemExit) as stopped:
        export_main(
            ["convert", str(export), str(destination), "--layout", layout, "--target", str(tiny_qwen3_dir)]
        )
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "LiLiCorr drafter" in error[0] and "--layout zlab" in error[0], error
    assert not destination.exists()


def test_converting_to_its_own_layout_keeps_every_weight(export, tmp_path, tiny_qwen3_dir):
    export_main(
        ["convert", str(export), str(tmp_path / "again"), "--layout", "zlab", "--target", str(tiny_qwen3_dir)]
    )
    before, after = load_drafter(export).state_dict(), load_drafter(tmp_path / "again").state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_the_convolutions_taps_are_held_to_the_block_wherever_the_block_size_is_written(tmp_path):
    """LiLiCorr's convolutions follow DFlash2's rule (one function): taps past the block are refused
    whether `block_size` stands at the top level or only inside dflash_config."""
    from dflash.drafters.lilicorr import lattice_problems
    from tests.test_lilicorr import lilicorr_config

    drafter = LiLiCorrDrafter(lilicorr_config(tiny_target(), conv_kernel_size=2, conv_group_size=16))
    export_drafter(drafter, tmp_path / "conv")
    config = json.loads((tmp_path / "conv" / "config.json").read_text())
    block = config["block_size"]
    config["dflash_config"]["conv_kernel_size"] = block + 1
    nested_only = {key: value for key, value in config.items() if key != "block_size"}
    nested_only["dflash_config"] = {**config["dflash_config"], "block_size": block}
    for written in (config, nested_only):
        assert [p for p in lattice_problems(written) if "conv_kernel_size" in p] == [
            f"dflash_config.conv_kernel_size={block + 1}: must be in 1..block_size ({block})"
        ]
