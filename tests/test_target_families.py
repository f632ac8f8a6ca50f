"""Every target family of the table (dflash/target/families.py), from its checkpoint directory as
published: causal LMs and the image-text Qwen3.5 / Qwen3.5-MoE (Qwen3.6) layout, whose language
model alone is loaded. Anything else is refused before any weights load. The supported list of
docs/configuration.md and the target presets agree with the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash.config.schema import TargetConfig
from dflash.run.launch import build_run
from dflash.target.families import TARGET_FAMILIES
from dflash.target.model import FrozenTarget
from dflash.train import train
from tests.conftest import FAMILIES, TINY_ARCH, conversation_overrides, tiny_hybrid_arch

IMAGE_TEXT = [family.model_type for family in TARGET_FAMILIES if family.image_text]
ROOT = Path(__file__).resolve().parent.parent


def family_dir(request, family: str) -> Path:
    return request.getfixturevalue(f"tiny_{family}_dir")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_decodes_losslessly_and_exports_its_text_depth(family, make_cfg, request):
    """`target=hf target.path=DIR` for each family: a few steps on CPU, fp32 DFlash decoding
    identical to plain greedy, and an export in the z-lab layout whose num_target_layers is the
    text stack's depth (6), with no embedding, LM head or vision weight."""
    cfg = make_cfg(
        [
            "target=hf",
            f"target.path={family_dir(request, family)}",
            "train.total_steps=4",
            "logger.every_steps=2",
        ]
    )
    summary = train(cfg)
    assert summary["steps"] == 4 and summary["eval/lossless_frac"] == 1.0
    exported = Path(summary["checkpoint"])
    config = json.loads((exported / "config.json").read_text())
    assert config["num_target_layers"] == TINY_ARCH["num_hidden_layers"]
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    with safe_open(str(exported / "model.safetensors"), "pt") as handle:
        keys = list(handle.keys())
    assert keys and all(k.startswith(("layers.", "fc.", "hidden_norm.", "norm.")) for k in keys)
    check = json.loads((Path(cfg.paths.output_dir) / "feature_check.json").read_text())
    assert [layer["layer"] for layer in check["layers"]] == [1, 3] and check["problems"] == []


@pytest.mark.parametrize("family", IMAGE_TEXT)
def test_image_text_checkpoint_loads_its_language_model_and_never_the_vision_tower(family, request):
    """The features are the published model's own language-model hidden states (the
    `model.language_model.*` weights, not a fresh init), and no vision weight is loaded."""
    from transformers import AutoModelForImageTextToText

    directory = family_dir(request, family)
    target = FrozenTarget.from_config(
        TargetConfig(name="hf", path=str(directory), model_type=None), [1, 3], torch.device("cpu")
    )
    assert not any("visual" in name for name, _ in target.model.named_parameters())
    assert target.config.num_hidden_layers == 6 and target.config.model_type == f"{family}_text"
    published = AutoModelForImageTextToText.from_pretrained(directory).eval()
    ids = torch.randint(1, 500, (2, 9))
    with torch.no_grad():
        hidden = published.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states
        logits = published(input_ids=ids).logits
    torch.testing.assert_close(target.features(ids), torch.cat([hidden[2], hidden[4]], dim=-1))
    torch.testing.assert_close(target(ids).logits, logits)


@pytest.mark.parametrize("family", IMAGE_TEXT)
def test_a_preset_names_the_image_text_model_type_and_refuses_the_other(family, make_cfg, request, tmp_path):
    other = "qwen3_5" if family == "qwen3_5_moe" else "qwen3_5_moe"
    directory = family_dir(request, family)
    run = build_run(make_cfg([f"target={family}", f"target.path={directory}", "train.total_steps=1"]))
    assert run.trainer.target.config.model_type == f"{family}_text"
    with pytest.raises(ValueError, match=f"holds a '{family}' model, but target={other} expects"):
        build_run(make_cfg([f"target={other}", f"target.path={directory}"], tmp_path / "other"))


def test_an_unsupported_model_type_is_refused_before_loading_naming_it(make_cfg, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", n_layer=6, n_embd=32, n_head=2, vocab_size=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt2")

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the model type was checked")

    monkeypatch.setattr(FrozenTarget, "from_config", no_load)
    supported = "llama, mistral, qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next"
    with pytest.raises(
        ValueError, match=f"model_type 'gpt2' is not a supported target \\(supported: {supported}\\)"
    ):
        build_run(make_cfg(["target=hf", f"target.path={tmp_path / 'gpt2'}"]))
    with pytest.raises(ValueError, match="target.model_type \\(target=tiny\\): model_type 'gpt2'"):
        build_run(make_cfg(["target.model_type=gpt2"], tmp_path / "random"))


def test_a_qwen3_5_directory_gives_its_tokenizer_and_chat_template(tmp_path, make_cfg, tiny_conversations):
    """Conversation data rendered with the template of a Qwen3.5 directory (which ships a
    processor config beside its tokenizer) trains."""
    from tests.tiny_assets import save_tiny_target_with_tokenizer

    directory = save_tiny_target_with_tokenizer(tmp_path / "qwen3_5_chat", model_type="qwen3_5")
    (directory / "preprocessor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    overrides = conversation_overrides(directory, [tiny_conversations])
    from dflash.target.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(TargetConfig(name="hf", path=str(directory), model_type=None), "the test")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert rendered.startswith("<|im_start|>user")  # the directory's own template
    summary = train(make_cfg(["target=hf"] + overrides + ["train.total_steps=2"]))
    assert summary["steps"] == 2 and summary["train/loss"] > 0  # supervised tokens were found


def test_a_target_of_expert_mlps_only_needs_the_drafters_mlp_width(make_cfg):
    """Qwen3.5-MoE has no dense MLP width to copy: the drafter's is asked for, never defaulted."""
    overrides = ["target=qwen3_5_35b_a3b_random", "drafter.target_layer_ids=[1,3]"]
    with pytest.raises(
        ValueError, match="drafter.intermediate_size must be set: the target \\(qwen3_5_moe_text\\)"
    ):
        build_run(make_cfg(overrides + tiny_hybrid_arch()))


def test_random_image_text_targets_build_their_language_model(make_cfg):
    """target=qwen3_5_35b_a3b_random's keys at tiny sizes: the text model, no vision tower."""
    overrides = [
        "target=qwen3_5_35b_a3b_random",
        "train.total_steps=1",
        "drafter.target_layer_ids=[1,3]",
        "drafter.intermediate_size=128",
    ]
    run = build_run(make_cfg(overrides + tiny_hybrid_arch()))
    model = run.trainer.target.model
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert model.config.layer_types == ["linear_attention", "full_attention"] * 3


def test_the_configuration_guide_lists_exactly_the_supported_families():
    """docs/configuration.md's "Supported families:" (the README links it) are the table's
    names, in its order."""
    readme = (ROOT / "docs" / "configuration.md").read_text()
    listed = readme.split("Supported families: ", 1)[1].split(" (", 1)[0]
    assert listed.split(", ") == [family.name for family in TARGET_FAMILIES]


def test_every_target_preset_belongs_to_the_family_it_names():
    """Each conf/target preset with a model_type is one family's, and that family lists it."""
    import yaml

    files = {
        path.stem: yaml.safe_load(path.read_text()) for path in (ROOT / "conf" / "target").glob("*.yaml")
    }

    def model_type(name: str) -> str | None:
        """The preset's model_type, its own or the one of the preset it starts from (defaults)."""
        own = files[name].get("model_type")
        parents = [d for d in files[name].get("defaults", []) if isinstance(d, str) and d in files]
        return own or next((model_type(parent) for parent in parents), None)

    presets = {name: model_type(name) for name in sorted(files)}
    listed = {preset: family for family in TARGET_FAMILIES for preset in family.presets}
    assert sorted(listed) == sorted(name for name, model_type in presets.items() if model_type)
    for preset, family in listed.items():
        assert presets[preset] in (family.model_type, family.text_model_type), preset
