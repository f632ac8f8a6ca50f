"""Config values that name a model to load (`target.path`, `target.tokenizer`): a local path that
does not exist is refused in one line naming the key and the path, before dflash-train imports
its model code; a value written as a Hugging Face hub id (`namespace/name`) is left to
transformers (its cache or the hub), as the rule in dflash/target/model_dirs.py says."""

from __future__ import annotations

import sys

import pytest

from dflash.target.model_dirs import is_hub_id, refuse_missing_model_dir


@pytest.mark.parametrize(
    "value",
    ["/models/Qwen3-8B", "./models/Qwen3-8B", "../Qwen3-8B", "~/no-such-model", "models/Qwen/Qwen3-8B"],
)
def test_a_local_path_that_does_not_exist_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=rf"^target.path={value}: no such directory .*namespace/name"):
        refuse_missing_model_dir("target.path", value)


@pytest.mark.parametrize(
    "value", ["Qwen/Qwen3-8B", "gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct", "org/name.v1"]
)
def test_a_hub_id_is_left_to_transformers(value):
    assert is_hub_id(value)
    refuse_missing_model_dir("target.path", value)


def test_a_file_is_refused_as_no_checkpoint_directory(tmp_path):
    """target.path=DIR/config.json ended in "[Errno 20] Not a directory", naming no key."""
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^target.path=.*config.json: a file, not a checkpoint directory"):
        refuse_missing_model_dir("target.path", str(tmp_path / "config.json"))


def test_a_path_under_home_is_looked_up_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models" / "mine").mkdir(parents=True)
    refuse_missing_model_dir("target.path", "~/models/mine")
    with pytest.raises(ValueError, match=r"target.path=~/models/other: no such directory"):
        refuse_missing_model_dir("target.path", "~/models/other")


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        (["target=hf", "target.path=/models/Qwen3-8B"], r"^target.path=/models/Qwen3-8B: no such directory"),
        (["target.tokenizer=/models/tokenizer"], r"^target.tokenizer=/models/tokenizer: no such directory"),
        (
            ["target=hf", "target.path=/models/qwen3-8b.gguf"],
            r"^target.path=/models/qwen3-8b.gguf: .* is not a file",
        ),
    ],
    ids=["path", "tokenizer", "gguf"],
)
def test_dflash_train_refuses_a_missing_target_path_before_importing_its_model_code(
    make_cfg, monkeypatch, overrides, refusal
):
    """`dflash train target=hf target.path=/models/Qwen3-8B` (no such directory) was refused by the
    hub's "Repo id must be in the form ..." after 11-21 s of imports. The refusal now comes before
    the run's model code is imported: with that import made to fail, the ValueError still comes."""
    from dflash.train import train

    monkeypatch.setitem(sys.modules, "dflash.run.launch", None)  # importing it raises ImportError
    with pytest.raises(ValueError, match=refusal):
        train(make_cfg(overrides))


def test_every_tool_that_reads_the_target_names_a_missing_directory(tmp_path):
    """The tools that build the target or its tokenizer from a typed config (dflash eval, regen,
    prep, the scripts) go through load_target_config and load_tokenizer: the same one line."""
    from dflash.config.schema import TargetConfig
    from dflash.target.model import load_target_config
    from dflash.target.tokenizer import load_tokenizer

    missing = str(tmp_path / "Qwen3-8B")
    with pytest.raises(ValueError, match=r"^target.path=.*Qwen3-8B: no such directory"):
        load_target_config(TargetConfig(name="hf", path=missing))
    with pytest.raises(ValueError, match=r"^target.path=.*Qwen3-8B: no such directory"):
        load_tokenizer(TargetConfig(name="hf", path=missing), "dflash-regen")
    with pytest.raises(ValueError, match=r"^target.tokenizer=.*tok: no such directory"):
        load_tokenizer(TargetConfig(name="tiny", tokenizer=str(tmp_path / "tok")), "eval.benchmarks")


def test_dflash_val_refuses_a_missing_checkpoint_before_loading_the_target(tmp_path, monkeypatch, capsys):
    """`dflash val --ckpt DIR` with no such directory loaded the target and the data first, then
    ended in a traceback; now one line naming --ckpt, exit 2, and nothing built."""
    from dflash.tools import val

    def never(*args, **kwargs):
        raise AssertionError("the target was built before --ckpt was checked")

    monkeypatch.setattr("dflash.run.inputs.script_target", never)
    with pytest.raises(SystemExit) as stopped:
        val.main(["--ckpt", str(tmp_path / "missing"), "gpu=cpu"])
    assert stopped.value.code == 2
    assert (
        capsys.readouterr().err.strip()
        == f"dflash val: error: --ckpt {tmp_path / 'missing'}: no such drafter directory"
    )
