"""`dflash export check`: every export dflash writes keeps the contract of docs/EXPORT.md, and
each broken case a serving reader would misread is named, one line each, exit 2. `check` refuses
what any reader refuses or misreads, and `convert` writes nothing `check` would refuse:
non-finite weights, a speculators directory without what speculators' and vLLM's readers take
from it (`speculators_config`, the target's tables), a declared block other than the trained one,
a mask id outside the vocabulary. A converted directory gets the mode a checkpoint gets."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from dflash.export.contract import check_export
from dflash.export.zlab import export_drafter, load_drafter, write_layout
from dflash.tools.export import main as export_main
from dflash.train import train
from tests.conftest import run_module
from tests.test_dflash_rules import tiny_drafter, tiny_target
from tests.test_dspark_export import tiny_dspark
from tests.test_speculators import export_cli
from tests.test_speculators import tiny_drafter as tiny_speculators_drafter

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
    assert len(lines) == 2 and all(line.startswith("dflash export: ") for line in lines)


VERIFIER = {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}


def with_nans(directory: Path, name: str = "layers.0.mlp.down_proj.weight", count: int = 1024) -> None:
    path = directory / "model.safetensors"
    weights = load_file(str(path))
    weights[name].view(-1)[:count] = float("nan")
    save_file(weights, str(path))


def test_nan_weights_are_refused_by_check_convert_and_the_loader(tmp_path, capsys):
    export_drafter(tiny_speculators_drafter(), tmp_path / "zlab")
    with_nans(tmp_path / "zlab")
    weights = tmp_path / "zlab" / "model.safetensors"
    line = f"{weights}: tensor layers.0.mlp.down_proj.weight holds 1024 non-finite values (NaN or inf) of "
    problems = check_export(tmp_path / "zlab")
    assert len(problems) == 1 and problems[0].startswith(line), problems
    code, err = export_cli(capsys, "check", str(tmp_path / "zlab"))
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"dflash export: {line}")
    code, err = export_cli(
        capsys, "convert", str(tmp_path / "zlab"), str(tmp_path / "dst"), "--layout", "zlab"
    )
    assert code == 2 and line in err and not (tmp_path / "dst").exists()
    with pytest.raises(ValueError, match="non-finite values"):  # dflash eval, drafter.init_from
        load_drafter(tmp_path / "zlab")


def test_an_infinite_value_is_refused_too(tmp_path):
    export_drafter(tiny_speculators_drafter(), tmp_path)
    path = tmp_path / "model.safetensors"
    weights = load_file(str(path))
    weights["norm.weight"][3] = float("inf")
    save_file(weights, str(path))
    assert [p.split(": ", 1)[1] for p in check_export(tmp_path)] == [
        "tensor norm.weight holds 1 non-finite values (NaN or inf) of 64"
    ]


def speculators_export(tmp_path: Path, tiny_qwen3_dir: Path, kind: str) -> Path:
    drafter = tiny_dspark(tiny_target()) if kind == "dspark" else tiny_speculators_drafter()
    write_layout(drafter, tmp_path / kind, "speculators", target_dir=tiny_qwen3_dir, verifier=VERIFIER)
    assert check_export(tmp_path / kind) == []
    return tmp_path / kind


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_speculators_export_without_speculators_config_is_refused(tmp_path, tiny_qwen3_dir, kind):
    """vLLM reads the proposal length and the verifier there and refuses a config without them
    (the DFlash2 layout was already held to it; DFlash and DSpark now are too)."""
    directory = speculators_export(tmp_path, tiny_qwen3_dir, kind)
    edit_config(directory, lambda c: c.pop("speculators_config"))
    assert check_export(directory) == [
        f"{directory / 'config.json'}: speculators_config is None: vLLM reads the proposal length and the "
        "verifier there (and refuses the config without them)"
    ]


@pytest.mark.parametrize(
    "kind, edit, expected",
    [
        (
            "dspark",
            lambda c: c["speculators_config"].update(algorithm="dflash"),
            "algorithm is 'dflash', not 'dspark'",
        ),
        (
            "dspark",
            lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=3),
            "proposes [3] tokens; a block of 4 drafts 4 (every slot predicts)",
        ),
        (
            "dflash",
            lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4),
            "proposes [4] tokens; a block of 4 drafts 3 (position 0 is the given token)",
        ),
        ("dflash", lambda c: c["speculators_config"].pop("verifier"), "verifier.name_or_path is missing"),
        ("dflash", lambda c: c.update(architectures=["Eagle3Speculator"]), "not ['DFlashDraftModel']"),
    ],
    ids=["dspark_algorithm", "dspark_proposals", "dflash_proposals", "no_verifier", "architecture"],
)
def test_what_vllm_reads_from_speculators_config_is_checked(tmp_path, tiny_qwen3_dir, kind, edit, expected):
    directory = speculators_export(tmp_path, tiny_qwen3_dir, kind)
    edit_config(directory, edit)
    problems = check_export(directory)
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_a_speculators_export_without_the_targets_tables_is_refused(tmp_path, tiny_qwen3_dir, kind):
    """speculators' loader (every kind: its DraftVocabMixin) fills the tables from the verifier
    only when they read as NaN, and memory transformers leaves uninitialised does not."""
    directory = speculators_export(tmp_path, tiny_qwen3_dir, kind)
    path = directory / "model.safetensors"
    save_file({k: v for k, v in load_file(str(path)).items() if k != "lm_head.weight"}, str(path))
    problems = check_export(directory)
    assert len(problems) == 1 and problems[0].startswith(
        f"{path}: tensor lm_head.weight is missing (speculators' loader reads the target's embedding"
    ), problems


def test_the_declared_block_must_be_the_trained_one(tmp_path, capsys):
    """A checkpoint's config.yaml records the run's drafter.block_size: a config.json that
    declares another block is refused by check and convert; so is a z-lab config whose two
    block fields disagree (readers take one or the other)."""
    source = tmp_path / "ckpt"
    export_drafter(tiny_speculators_drafter(), source)  # block 4
    (source / "config.yaml").write_text(yaml.safe_dump({"drafter": {"block_size": 4}}))
    assert check_export(source) == []
    edit_config(source, lambda c: c.update(block_size=8))
    line = (
        f"{source / 'config.json'}: block_size 8, but the drafter was trained with drafter.block_size=4 "
        f"({source / 'config.yaml'}): serve it at the block it was trained with"
    )
    assert check_export(source) == [line]
    code, err = export_cli(capsys, "convert", str(source), str(tmp_path / "dst"), "--layout", "zlab")
    assert code == 2 and err == f"dflash export: {line}\n" and not (tmp_path / "dst").exists()

    edit_config(
        source, lambda c: c.update(block_size=4, dflash_config={**c["dflash_config"], "block_size": 8})
    )
    problems = check_export(source)
    assert len(problems) == 1 and "block_size 4 differs from dflash_config.block_size 8" in problems[0]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c: c.pop("vocab_size"), "vocab_size is None: the target's vocabulary size is needed"),
        (lambda c: c["dflash_config"].update(mask_token_id=True), "dflash_config.mask_token_id is True"),
        (
            lambda c: c["dflash_config"].update(mask_token_id=512),
            "mask_token_id 512 is outside the vocabulary (512)",
        ),
    ],
    ids=["no_vocab", "bool_mask", "mask_past_vocab"],
)
def test_the_mask_id_must_lie_inside_the_vocabulary(tmp_path, edit, expected):
    """Without vocab_size transformers reads 151936, so a mask id past a 512-token target's
    vocabulary would pass unchecked (with --target it is checked against the target's)."""
    export_drafter(tiny_speculators_drafter(), tmp_path)
    edit_config(tmp_path, edit)
    problems = check_export(tmp_path)
    assert len(problems) == 1 and expected in problems[0], problems


def test_convert_writes_the_mode_a_checkpoint_gets(tmp_path, capsys):
    """Not mkdtemp's 0700: a server running as another user reads the converted directory."""
    previous = os.umask(0o022)
    try:
        export_drafter(tiny_speculators_drafter(), tmp_path / "ckpt")
        code, err = export_cli(
            capsys, "convert", str(tmp_path / "ckpt"), str(tmp_path / "dst"), "--layout", "zlab"
        )
    finally:
        os.umask(previous)
    assert code == 0, err
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "dst") == mode(tmp_path / "ckpt") == 0o755
    assert mode(tmp_path / "dst" / "model.safetensors") == 0o644


def test_the_tool_calls_itself_by_the_command_users_type(capsys):
    with pytest.raises(SystemExit):
        export_main(["--help"])
    assert capsys.readouterr().out.startswith("usage: dflash export ")
    code, err = export_cli(capsys, "check", "/nonexistent/drafter")
    assert code == 2 and err == "dflash export: error: /nonexistent/drafter: no such directory\n"
