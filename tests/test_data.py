"""Target-generated training text: prompts are context, continuations supervised; cached on disk."""

from __future__ import annotations

import torch

from dflash.config.schema import DataConfig, SyntheticText, TargetConfig
from dflash.data import synthetic
from dflash.data.synthetic import load_or_generate
from dflash.decoding.reference import plain_generate
from dflash.decoding.settings import DecodeSettings
from tests.test_dflash_rules import tiny_target

TARGET_CFG = TargetConfig(name="tiny", arch={"vocab_size": 512})


def small_data(**kw) -> DataConfig:
    return DataConfig(
        name="t",
        num_samples=6,
        prompt_len_min=4,
        prompt_len_max=9,
        gen_len_min=5,
        gen_len_max=12,
        max_length=64,
        generation_batch_size=4,
        **kw,
    )


def test_samples_are_prompt_then_the_targets_greedy_continuation(tmp_path):
    target = tiny_target()
    dataset = load_or_generate(target, TARGET_CFG, small_data(), tmp_path, excluded_token_ids=[511])
    assert len(dataset) == 6
    for index in range(6):
        ids, mask = dataset[index]
        prompt_len = int((mask == 0).sum())
        assert mask[:prompt_len].sum() == 0 and mask[prompt_len:].all()  # prompt = context only
        assert 511 not in ids[:prompt_len].tolist()  # the mask id never appears in a prompt
        continuation = plain_generate(
            target, ids[:prompt_len].tolist(), DecodeSettings(len(ids) - prompt_len)
        ).output_ids
        assert ids[prompt_len:].tolist() == continuation


def test_second_run_reuses_the_cache_and_a_new_seed_does_not(tmp_path, monkeypatch):
    target = tiny_target()
    first = load_or_generate(target, TARGET_CFG, small_data(), tmp_path, [511])

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again instead of reusing the cache")

    monkeypatch.setattr(synthetic, "generate_dataset", no_generation)
    again = load_or_generate(target, TARGET_CFG, small_data(), tmp_path, [511])
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.loss_mask, again.loss_mask)
    monkeypatch.undo()
    other = load_or_generate(target, TARGET_CFG, small_data(seed=1), tmp_path, [511])
    assert not torch.equal(first.input_ids[:20], other.input_ids[:20])
    assert len(list((tmp_path / "synthetic").glob("*.safetensors"))) == 2


def test_random_continuations_need_no_target_and_keep_the_mask_id_out(tmp_path, monkeypatch):
    """data.continuation=random (speed runs of large targets): same prompts as greedy data, a
    supervised part of random tokens of the drawn length, never the mask id, cached like the rest."""
    target = tiny_target()

    def no_generation(*args, **kwargs):
        raise AssertionError("random continuations called the target")

    greedy = load_or_generate(target, TARGET_CFG, small_data(), tmp_path, [511])
    monkeypatch.setattr(synthetic, "greedy_continue", no_generation)
    random_cfg = small_data(continuation=SyntheticText.random)
    dataset = load_or_generate(target, TARGET_CFG, random_cfg, tmp_path, [511])
    assert len(dataset) == 6
    for index in range(6):
        ids, mask = dataset[index]
        greedy_ids, greedy_mask = greedy[index]
        assert torch.equal(mask, greedy_mask)  # the same prompts and lengths
        prompt_len = int((mask == 0).sum())
        assert torch.equal(ids[:prompt_len], greedy_ids[:prompt_len])
        assert 511 not in ids.tolist()
    again = synthetic.generate_dataset(target, random_cfg, [511])
    assert torch.equal(again.input_ids, dataset.input_ids)
