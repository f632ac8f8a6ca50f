"""A target is compared by content: resume, drafter.init_from, dflash-eval and dflash-export
check/convert --target refuse a checkpoint trained on a same-shape target with other weights or
another tokenizer, and accept the same target named another way (a trailing slash, a link)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dflash.config.schema import TargetConfig
from dflash.run.resume import check_resume_matches
from dflash.target.target_identity import target_identity
from dflash.tools.eval import check_same_target
from dflash.trainer.checkpoint import save_checkpoint
from tests.test_dflash_rules import tiny_drafter, tiny_target


@pytest.fixture
def targets(tmp_path, tiny_chat_dir):
    """The chat target, the same shape with one weight changed, and with another tokenizer."""
    same = shutil.copytree(tiny_chat_dir, tmp_path / "same")
    other_weights = shutil.copytree(tiny_chat_dir, tmp_path / "other_weights")
    weights = load_file(str(other_weights / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1e-3
    save_file(weights, str(other_weights / "model.safetensors"), metadata={"format": "pt"})
    other_tokenizer = shutil.copytree(tiny_chat_dir, tmp_path / "other_tokenizer")
    tokenizer = json.loads((other_tokenizer / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two ids swapped: another tokenizer
    (other_tokenizer / "tokenizer.json").write_text(json.dumps(tokenizer))
    return {"same": same, "other_weights": other_weights, "other_tokenizer": other_tokenizer}


def checkpoint_for(tmp_path, target_dir):
    target = tiny_target()
    drafter = tiny_drafter(target)
    identity = target_identity(TargetConfig(name="hf", path=str(target_dir)))
    path = save_checkpoint(tmp_path / "ckpt", 1, drafter, {}, f"target:\n  path: {target_dir}\n", 1, target_identity=identity)  # fmt: skip
    return path, drafter.config


def test_resume_refuses_same_shape_targets_of_other_content_and_accepts_the_same_one(tmp_path, targets):
    ckpt, config = checkpoint_for(tmp_path, targets["same"])
    for name, expected in (
        ("other_weights", "weights differ"),
        ("other_tokenizer", "tokenizer vocabulary differ"),
    ):
        identity = target_identity(TargetConfig(name="hf", path=str(targets[name])))
        with pytest.raises(ValueError, match=f"trained for another drafter or target .*{expected}"):
            check_resume_matches(ckpt, config, {"path": str(targets[name])}, run_identity=identity)
    (tmp_path / "link").symlink_to(targets["same"])
    for named in (f"{targets['same']}/", str(tmp_path / "link")):
        identity = target_identity(TargetConfig(name="hf", path=named))
        check_resume_matches(ckpt, config, {"path": named}, run_identity=identity)


def test_a_checkpoint_without_target_json_compares_paths_as_directories(tmp_path, targets):
    """Checkpoints written before target.json: the run config's path, trailing slash or not."""
    ckpt, config = checkpoint_for(tmp_path, targets["same"])
    (ckpt / "target.json").unlink()
    check_resume_matches(ckpt, config, {"path": f"{targets['same']}/"})
    with pytest.raises(ValueError, match="target.path"):
        check_resume_matches(ckpt, config, {"path": str(targets["other_weights"])})


def test_dflash_eval_refuses_a_target_of_the_same_shape_with_other_weights(tmp_path, targets):
    ckpt, _ = checkpoint_for(tmp_path, targets["same"])
    check_same_target(ckpt, TargetConfig(name="hf", path=f"{targets['same']}/"), "target=hf")
    with pytest.raises(
        ValueError, match=r"another target than target=hf \(weights differ\).*eval.check_target=false"
    ):
        check_same_target(ckpt, TargetConfig(name="hf", path=str(targets["other_weights"])), "target=hf")


def test_a_random_target_is_its_architecture_and_seed():
    one = target_identity(TargetConfig(name="r", arch={"hidden_size": 64}, init_seed=0))
    assert one == target_identity(TargetConfig(name="r", arch={"hidden_size": 64}, init_seed=0))
    assert one != target_identity(TargetConfig(name="r", arch={"hidden_size": 64}, init_seed=1))
    # The same random target quantized to FP8 (target.fp8) computes other features.
    assert one != target_identity(TargetConfig(name="r", arch={"hidden_size": 64}, init_seed=0, fp8=True))


def test_export_check_and_convert_apply_the_same_pairing_rule(tmp_path, targets, capsys):
    """dflash-export check/convert --target refuse what dflash-eval refuses: a drafter that
    records its target (target.json; a speculators verifier directory) with a same-shape target
    of other weights or another tokenizer; and a target of another vocabulary by shape."""
    from tests.test_speculators import export_cli

    ckpt, _ = checkpoint_for(tmp_path, targets["same"])
    code, err = export_cli(capsys, "check", str(ckpt), "--target", str(targets["same"]))
    assert code == 0, err
    spec = tmp_path / "spec"
    code, err = export_cli(capsys, "convert", str(ckpt), str(spec), "--layout", "speculators", "--target", str(targets["same"]))  # fmt: skip
    assert code == 0, err
    for name, expected in (("other_weights", "weights differ"), ("other_tokenizer", "tokenizer vocabulary differ")):  # fmt: skip
        other = str(targets[name])
        for command in (
            ["check", str(ckpt)],
            ["convert", str(spec), str(tmp_path / f"zlab_{name}"), "--layout", "zlab"],
        ):
            code, err = export_cli(capsys, *command, "--target", other)
            assert code == 2 and err.count("\n") == 1, err
            assert f"was made for another target than --target {other} ({expected})" in err
        assert not (tmp_path / f"zlab_{name}").exists()
    wider = shutil.copytree(targets["same"], tmp_path / "wider_vocab")
    config = json.loads((wider / "config.json").read_text())
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] * 2}))
    (ckpt / "target.json").unlink()  # a drafter from elsewhere: only the shapes tell
    code, err = export_cli(capsys, "check", str(ckpt), "--target", str(wider))
    assert (
        code == 2
        and f"vocab_size {config['vocab_size']} but the target's is {config['vocab_size'] * 2}" in err
    )
