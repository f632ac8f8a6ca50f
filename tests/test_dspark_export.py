"""DSpark drafters as their readers load them: every checkpoint in DeepSpec's layout (what
SGLang, vLLM and llama.cpp's converter read), checked by `dflash export check` with the heads'
rules, read back bit for bit, and DeepSpec's and speculators' own checkpoints (built here in
their published layouts) loaded for fine-tuning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.config.schema import DrafterConfig
from dflash.drafters.backbone import drafter_config
from dflash.drafters.dspark import DSparkDrafter, add_dspark_fields
from dflash.export.contract import check_export, reader_limits
from dflash.export.zlab import export_drafter, load_drafter, load_drafter_weights, read_drafter_config
from dflash.target.model import FrozenTarget
from dflash.tools.export import main as export_main
from tests.test_dflash_rules import MASK_ID, tiny_target

TINY_TARGET = {"num_hidden_layers": 6, "hidden_size": 64, "vocab_size": 512}
RANK = 8


def tiny_dspark(
    target: FrozenTarget,
    *,
    head_type: str = "vanilla",
    rank: int = RANK,
    confidence: bool = True,
    with_markov: bool = True,
    block_size: int = 4,
    seed: int = 1,
) -> DSparkDrafter:
    """A DSpark drafter on the tiny target; weights moved off their init (they must really load)."""
    cfg = DrafterConfig(name="t", num_layers=2, block_size=block_size, mask_token_id=MASK_ID, num_anchors=8)
    config = drafter_config(cfg, target.config, target.layer_ids)
    add_dspark_fields(
        config,
        markov_rank=rank,
        markov_head_type=head_type,
        confidence_head=confidence,
        confidence_with_markov=with_markov,
    )
    config.num_anchors = cfg.num_anchors
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return drafter


def write_as_deepspec_does(directory: Path, drafter: DSparkDrafter, target: FrozenTarget) -> Path:
    """A checkpoint as DeepSpec's trainer saves one (deepspec/modeling/dspark/qwen3/config.py,
    trainer/ckpt_manager.py): the target's config copied with the draft fields at the top level,
    no dflash_config; the drafter's tensors under the same names plus the target's embedding and
    LM head; bf16."""
    config = target.config.to_dict()
    draft = drafter.config
    config.update(
        architectures=["Qwen3DSparkModel"],
        num_target_layers=target.config.num_hidden_layers,
        num_hidden_layers=draft.num_hidden_layers,
        block_size=draft.block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * draft.num_hidden_layers,
        mask_token_id=draft.dflash_config["mask_token_id"],
        target_layer_ids=draft.dflash_config["target_layer_ids"],
        num_anchors=512,
        enable_confidence_head=draft.enable_confidence_head,
        markov_rank=draft.markov_rank,
        dtype="bfloat16",
    )
    if draft.enable_confidence_head:
        config["confidence_head_with_markov"] = draft.confidence_head_with_markov
    if draft.markov_rank > 0:
        config["markov_head_type"] = draft.markov_head_type
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        config[key] = getattr(draft, key)
    state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in drafter.state_dict().items()}
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().to(torch.bfloat16).clone()
    state["lm_head.weight"] = target.lm_head.weight.detach().to(torch.bfloat16).clone()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    return directory


def write_as_speculators_does(directory: Path, drafter: DSparkDrafter, target: FrozenTarget) -> Path:
    """A checkpoint as speculators saves a DSpark drafter (speculators/models/dspark/config.py,
    models/dflash/config.py): the draft layers' Qwen3 config nested, aux layer ids (decoder
    layer + 1), the heads' fields at the top level, the target's tables bundled."""
    draft = drafter.config
    layer = {
        key: value
        for key, value in draft.to_dict().items()
        if key
        not in (
            "architectures",
            "block_size",
            "num_target_layers",
            "dflash_config",
            "num_anchors",
            "markov_rank",
            "markov_head_type",
            "enable_confidence_head",
            "confidence_head_with_markov",
        )
    }
    config = {
        "speculators_model_type": "dspark",
        "architectures": ["DSparkDraftModel"],
        "transformer_layer_config": layer,
        "draft_vocab_size": draft.vocab_size,
        "block_size": draft.block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in draft.dflash_config["target_layer_ids"]],
        "mask_token_id": draft.dflash_config["mask_token_id"],
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
        "markov_rank": draft.markov_rank,
        "markov_head_type": draft.markov_head_type,
        "enable_confidence_head": draft.enable_confidence_head,
        "confidence_head_with_markov": draft.confidence_head_with_markov,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft.block_size}],
            "verifier": {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    state = {name: t.detach().contiguous() for name, t in drafter.state_dict().items()}
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    state["lm_head.weight"] = target.lm_head.weight.detach().clone()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    return directory


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


def test_a_dspark_export_is_deepspecs_layout_and_keeps_the_contract(tmp_path):
    target = tiny_target()
    drafter = tiny_dspark(target)
    export_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["mask_token_id"] == MASK_ID and config["target_layer_ids"] == [1, 3]
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]}
    assert config["block_size"] == 4 and config["num_target_layers"] == 6 and config["num_anchors"] == 8
    assert (config["markov_rank"], config["markov_head_type"]) == (RANK, "vanilla")
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert set(tensors) == set(drafter.state_dict())
    assert tensors["markov_head.markov_w1.weight"].shape == (512, RANK)
    assert tensors["markov_head.markov_w2.weight"].shape == (512, RANK)
    assert tensors["confidence_head.proj.weight"].shape == (1, 64 + RANK)
    assert tensors["confidence_head.proj.bias"].shape == (1,)
    assert check_export(tmp_path, target=TINY_TARGET) == []
    assert reader_limits(tmp_path) == []


@pytest.mark.parametrize(
    "heads",
    [
        dict(head_type="vanilla"),
        dict(head_type="gated"),
        dict(head_type="rnn"),
        dict(head_type="vanilla", with_markov=False),
        dict(head_type="vanilla", confidence=False),
    ],
    ids=["vanilla", "gated", "rnn", "confidence_without_markov", "no_confidence"],
)
def test_every_head_reads_back_bit_for_bit(tmp_path, heads):
    target = tiny_target()
    drafter = tiny_dspark(target, **heads)
    export_drafter(drafter, tmp_path)
    assert check_export(tmp_path, target=TINY_TARGET) == []
    loaded = load_drafter(tmp_path)
    assert isinstance(loaded, DSparkDrafter) and same_weights(drafter, loaded)
    assert loaded.config.markov_head_type == drafter.config.markov_head_type
    assert loaded.target_layer_ids == [1, 3] and loaded.mask_token_id == MASK_ID


def test_deepspecs_own_checkpoint_loads_for_fine_tuning(tmp_path):
    target = tiny_target()
    published = tiny_dspark(target, head_type="gated")
    directory = write_as_deepspec_does(tmp_path / "deepspec", published, target)
    assert check_export(directory, target=TINY_TARGET) == []  # bundled tables allowed there
    config = read_drafter_config(directory)
    assert config.dflash_config == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]}
    assert (config.markov_rank, config.markov_head_type, config.num_anchors) == (RANK, "gated", 512)
    # drafter.init_from: the run builds its drafter from its own config and takes the weights.
    fresh = tiny_dspark(target, head_type="gated", seed=7)
    load_drafter_weights(fresh, directory)
    bf16 = {k: v.to(torch.bfloat16) for k, v in published.state_dict().items()}
    assert all(torch.equal(fresh.state_dict()[k].to(torch.bfloat16), v) for k, v in bf16.items())


def test_a_speculators_dspark_checkpoint_loads_and_converts_both_ways(tmp_path, tiny_qwen3_dir, capsys):
    target = tiny_target()
    published = tiny_dspark(target, head_type="rnn")
    directory = write_as_speculators_does(tmp_path / "spec", published, target)
    assert check_export(directory, target=TINY_TARGET) == []
    loaded = load_drafter(directory)
    assert isinstance(loaded, DSparkDrafter) and same_weights(published, loaded)
    assert loaded.target_layer_ids == [1, 3]
    # speculators -> DeepSpec, self-contained as DeepSpec's loader wants it -> speculators gives
    # back every tensor. The speculators layout records no num_anchors, which DeepSpec asserts.
    to_deepspec = ["convert", str(directory), str(tmp_path / "ds"), "--layout", "deepspec"]
    with pytest.raises(SystemExit):
        export_main([*to_deepspec, "--target", str(tiny_qwen3_dir)])
    assert "--num-anchors" in capsys.readouterr().err
    export_main([*to_deepspec, "--target", str(tiny_qwen3_dir), "--num-anchors", "8"])
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["num_anchors"] == 8
    tables = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    bundled = load_file(str(tmp_path / "ds" / "model.safetensors"))
    assert torch.equal(bundled["lm_head.weight"], tables["lm_head.weight"].float())
    assert torch.equal(bundled["embed_tokens.weight"], tables["model.embed_tokens.weight"].float())
    export_main(
        [
            "convert",
            str(tmp_path / "ds"),
            str(tmp_path / "back"),
            "--layout",
            "speculators",
            "--target",
            str(tiny_qwen3_dir),
        ]
    )
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["speculators_model_type"] == "dspark" and back["sample_from_anchor"] is True
    assert back["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4  # every slot drafts
    assert back["aux_hidden_state_layer_ids"] == [2, 4]
    assert same_weights(published, load_drafter(tmp_path / "back"))
    with pytest.raises(SystemExit):
        export_main(["convert", str(tmp_path / "ds"), str(tmp_path / "z"), "--layout", "zlab"])
    assert "--layout deepspec" in capsys.readouterr().err


def test_a_speculators_dspark_drafter_with_the_bonus_anchor_is_refused(tmp_path):
    target = tiny_target()
    directory = write_as_speculators_does(tmp_path, tiny_dspark(target), target)
    config = json.loads((directory / "config.json").read_text())
    config["sample_from_anchor"] = False
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sample_from_anchor is false"):
        load_drafter(directory)


def edited_export(tmp_path: Path, *, config_edit=None, weights_edit=None) -> list[str]:
    target = tiny_target()
    export_drafter(tiny_dspark(target), tmp_path)
    if config_edit is not None:
        config = json.loads((tmp_path / "config.json").read_text())
        config_edit(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    if weights_edit is not None:
        path = str(tmp_path / "model.safetensors")
        save_file(weights_edit(load_file(path)), path)
    return check_export(tmp_path, target=TINY_TARGET)


def rank_four_w1(weights: dict) -> dict:
    weights["markov_head.markov_w1.weight"] = torch.zeros(512, 4)
    return weights


@pytest.mark.parametrize(
    "config_edit,weights_edit,expected",
    [
        (lambda c: c.pop("confidence_head_with_markov"), None, "confidence_head_with_markov is None"),
        (lambda c: c.pop("markov_head_type"), None, "markov_head_type is None"),
        (lambda c: c.pop("num_anchors"), None, "num_anchors is None: DeepSpec's loader asserts"),
        (
            lambda c: c.update(target_layer_ids=[1, 2]),
            None,
            "target_layer_ids [1, 2] differs from dflash_config",
        ),
        (lambda c: c.update(architectures=["DFlashDraftModel"]), None, "not ['Qwen3DSparkModel']"),
        (lambda c: c.update(sample_from_anchor=False), None, "sample_from_anchor is false"),
        (None, rank_four_w1, "markov_head.markov_w1.weight has shape [512, 4], the config needs [512, 8]"),
        (
            None,
            lambda w: {k: v for k, v in w.items() if "confidence" not in k},
            "confidence_head.proj.bias is missing",
        ),
        (
            None,
            lambda w: {**w, "markov_head.gate_proj.bias": torch.zeros(8)},
            "unexpected tensor markov_head.gate_proj",
        ),
    ],
    ids=[
        "with_markov_missing",
        "head_type_missing",
        "num_anchors_missing",
        "layer_ids_disagree",
        "dflash_architecture",
        "bonus_anchor",
        "wrong_rank",
        "confidence_missing",
        "gate_on_a_vanilla_head",
    ],
)
def test_broken_dspark_exports_are_named(tmp_path, config_edit, weights_edit, expected):
    problems = edited_export(tmp_path, config_edit=config_edit, weights_edit=weights_edit)
    assert any(expected in problem for problem in problems), problems


def test_readers_that_refuse_a_head_are_noted_and_the_check_still_passes(tmp_path, capsys):
    target = tiny_target()
    export_drafter(tiny_dspark(target, head_type="gated", with_markov=False), tmp_path)
    export_main(["check", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith("ok:")
    assert "note: markov_head_type gated: vLLM and llama.cpp build the vanilla head only" in out
    assert "note: a confidence head without the Markov embedding: llama.cpp" in out


def test_a_dspark_runs_checkpoints_keep_the_contract_and_deepspecs_own_starts_a_run(make_cfg, tmp_path):
    """variant=dspark: every checkpoint the run writes is DeepSpec's layout and passes the check;
    a checkpoint as DeepSpec publishes one (bf16, the target's tables bundled), or as
    speculators does, starts a run through drafter.init_from with its weights."""
    from dflash.run.launch import build_models
    from dflash.run.preflight import check_before_loading
    from dflash.train import train

    dspark = ["variant=dspark", "variant.markov_rank=16", "variant.markov_head_type=rnn"]
    cfg = make_cfg([*dspark, "train.total_steps=2"], tmp_path / "run")
    checkpoint = Path(train(cfg)["checkpoint"])
    config = json.loads((checkpoint / "config.json").read_text())
    assert (
        config["architectures"] == ["Qwen3DSparkModel"] and config["num_anchors"] == cfg.drafter.num_anchors
    )
    assert check_export(checkpoint, target=TINY_TARGET) == []
    trained = load_drafter(checkpoint)
    for layout, write, dtype in (
        ("deepspec", write_as_deepspec_does, torch.bfloat16),
        ("speculators", write_as_speculators_does, torch.float32),
    ):
        published = write(tmp_path / layout, trained, tiny_target())
        fine_tune = make_cfg(
            [*dspark, "train.total_steps=1", f"drafter.init_from={published}"], tmp_path / f"ft-{layout}"
        )
        started = build_models(check_before_loading(fine_tune)).drafters[0].state_dict()
        assert started.keys() == trained.state_dict().keys()
        for name, tensor in trained.state_dict().items():
            assert torch.equal(started[name], tensor.to(dtype).float()), (layout, name)


def test_a_head_class_of_ones_own_is_checked_as_the_loader_builds_it(tmp_path, monkeypatch, capsys):
    """A head class of the user's own (docs/extending.md's ScaledMarkovHead) passes with the
    tensors its class builds and is noted as dflash only; a head type dflash cannot build
    (`foo`, a module not on the path) or a tensor the class has no parameter for is refused,
    as `dflash eval` and `convert` refuse it, one line naming the file and the key or tensor."""
    from tests.test_extending import doc_example

    (tmp_path / "my_heads.py").write_text(doc_example("ScaledMarkovHead"))
    monkeypatch.syspath_prepend(str(tmp_path))
    export = tmp_path / "drafter"
    own = lambda c: c.update(markov_head_type="my_heads.ScaledMarkovHead")  # noqa: E731
    gain = lambda w: {**w, "markov_head.gain": torch.ones(RANK)}  # noqa: E731
    assert edited_export(export, config_edit=own, weights_edit=gain) == []
    assert any(
        "a head class of your own; dflash reads it, no engine builds it" in n for n in reader_limits(export)
    )
    stray = lambda w: {**gain(w), "markov_head.scale": torch.ones(1)}  # noqa: E731
    assert edited_export(export, config_edit=own, weights_edit=stray) == [
        f"{export / 'model.safetensors'}: unexpected tensor markov_head.scale (the drafter's class has no such parameter)"
    ]
    for head_type, reason in (
        ("foo", "expected one of vanilla, gated, rnn"),
        ("elsewhere.Head", "cannot import it"),
    ):
        problems = edited_export(export, config_edit=lambda c, t=head_type: c.update(markov_head_type=t))
        assert len(problems) == 1, problems
        assert problems[0].startswith(f"{export / 'config.json'}: markov_head_type={head_type!r}: {reason}")
        with pytest.raises(SystemExit) as stopped:
            export_main(["check", str(export)])
        assert stopped.value.code == 2 and capsys.readouterr().err.count("\n") == 1
        with pytest.raises(ValueError, match="markov_head_type"):
            load_drafter(export)
