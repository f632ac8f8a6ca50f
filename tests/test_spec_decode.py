"""Speculative decoding: lossless whatever the drafter, acceptance counted right, caches exact."""

from __future__ import annotations

import pytest
import torch

from dflash.decoding import reference
from dflash.decoding.reference import (
    DrafterContext,
    TargetSession,
    accepted_prefix,
    plain_generate,
    speculative_generate,
    supports_cache_crop,
)
from dflash.decoding.settings import DecodeSettings
from tests.test_dflash_rules import tiny_drafter, tiny_target


def greedy(target, prompt, n, cached=None):
    return plain_generate(target, prompt, DecodeSettings(n), cached=cached).output_ids


@pytest.mark.parametrize("cached", [True, False])
def test_output_equals_plain_greedy_even_with_an_untrained_drafter(cached):
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    prompt = torch.randint(0, 500, (12,)).tolist()
    result = speculative_generate(target, drafter, prompt, DecodeSettings(20), cached=cached)
    assert result.output_ids == greedy(target, prompt, 20, cached=False)
    assert sum(result.acceptance_lengths) == 20 - 1  # the first token comes from the prefill
    assert all(1 <= n <= drafter.block_size for n in result.acceptance_lengths)


def test_kv_cached_decoding_equals_full_recomputation():
    """The cached path (lower-right causal mask on a multi-token cached forward, cache cropped
    back after a rejection) gives the logits and features of a full forward."""
    target = tiny_target()
    assert supports_cache_crop(target)
    ids = torch.randint(0, 500, (30,)).tolist()
    full = target(torch.tensor([ids]))
    session = TargetSession(target, cached=True)
    logits, features = session.run(ids[:10])
    torch.testing.assert_close(logits, full.logits[0, :10])
    logits, features = session.run([7, 8, 9, 10])  # a rejected draft ...
    session.commit(10)  # ... cut back off
    logits, features = session.run(ids[10:16])
    torch.testing.assert_close(logits, full.logits[0, 10:16], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(features, full.features[:, 10:16], atol=1e-5, rtol=1e-5)
    assert session.cache.get_seq_length() == 16


def test_drafter_context_cache_equals_the_uncached_drafter():
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    ids = torch.randint(0, 500, (1, 14))
    features = target(ids).features
    context = DrafterContext(drafter)
    context.extend(features[:, :9])
    context.extend(features[:, 9:13])  # appended in two pieces, as decoding commits tokens
    cached = context.draft(target, int(ids[0, 13]))
    whole = DrafterContext(drafter)
    whole.extend(features[:, :13])
    assert cached == whole.draft(target, int(ids[0, 13]))


def test_a_perfect_drafter_is_accepted_whole_blocks(monkeypatch):
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    prompt = torch.randint(0, 500, (10,)).tolist()
    truth = greedy(target, prompt, 40)

    def oracle(context, target_, anchor_token):
        start = context.length + 1 - len(prompt)  # index in `truth` of the token after the anchor
        return truth[start : start + drafter.block_size - 1]

    monkeypatch.setattr(reference, "drafter_guess", oracle)
    result = speculative_generate(target, drafter, prompt, DecodeSettings(40))
    assert result.output_ids == truth
    assert result.acceptance_lengths[:-1] == [drafter.block_size] * (len(result.acceptance_lengths) - 1)


def test_acceptance_stops_at_the_first_disagreement():
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_prefix([5, 9, 7], [5, 6, 7, 8]) == 1  # 7 matches again, but after a miss
    assert accepted_prefix([4, 6, 7], [5, 6, 7, 8]) == 0


class ContextKeyedSampler:
    """A sampler whose draw depends only on the distribution it is given (Gumbel noise seeded by
    the row's top-5 token ids), not on how many draws came before. With it, "every committed
    token is the target's own sample given the committed prefix" becomes testable token for
    token: speculative and plain sampling must then write the same sequence."""

    def __init__(self, temperature, device, seed=0):
        self.temperature = temperature

    def __call__(self, logits_NV):
        picks = []
        for row in logits_NV.float():
            generator = torch.Generator().manual_seed(hash(tuple(row.topk(5).indices.tolist())) % 2**31)
            gumbel = -torch.log(-torch.log(torch.rand(row.shape, generator=generator)))
            picks.append(int((row / self.temperature + gumbel).argmax()))
        return picks


@pytest.mark.parametrize("drafter_kind", ["oracle", "untrained", "always_wrong"])
def test_sampled_decoding_commits_exactly_the_targets_samples(drafter_kind, monkeypatch):
    monkeypatch.setattr(reference, "TokenChooser", ContextKeyedSampler)
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    prompt = torch.randint(0, 500, (8,)).tolist()
    plain = plain_generate(target, prompt, DecodeSettings(30, temperature=1.0)).output_ids
    assert len(set(plain)) > 10  # really sampled: not a greedy loop
    if drafter_kind == "oracle":  # proposes the plain sampled continuation: whole blocks accepted

        def guess(context, target_, anchor_token):
            start = context.length + 1 - len(prompt)
            return plain[start : start + drafter.block_size - 1]

        monkeypatch.setattr(reference, "drafter_guess", guess)
    elif drafter_kind == "always_wrong":
        never = next(t for t in range(500) if t not in plain)  # a token this trajectory never samples
        monkeypatch.setattr(reference, "drafter_guess", lambda c, t, a: [never] * (drafter.block_size - 1))
    result = speculative_generate(target, drafter, prompt, DecodeSettings(30, temperature=1.0))
    assert result.output_ids == plain
    if drafter_kind == "oracle":
        assert result.acceptance_lengths[:-1] == [drafter.block_size] * (len(result.acceptance_lengths) - 1)
    if drafter_kind == "always_wrong":
        assert result.acceptance_lengths == [1] * 29


def test_fp32_drafter_drives_a_bf16_target():
    """The GPU layout (bf16 target, fp32 master-weight drafter), exercised on CPU."""
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    target.model.to(torch.bfloat16)
    prompt = torch.randint(0, 500, (8,)).tolist()
    result = speculative_generate(target, drafter, prompt, DecodeSettings(6))
    assert result.output_ids == greedy(target, prompt, 6)


def test_hybrid_targets_fall_back_to_exact_recomputation(tmp_path):
    from dflash.config.schema import TargetConfig
    from dflash.target.model import FrozenTarget
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "next", "qwen3_next")
    target = FrozenTarget.from_config(
        TargetConfig(name="n", path=str(path), model_type="qwen3_next"), [1, 3], torch.device("cpu")
    )
    assert not supports_cache_crop(target)
    drafter = tiny_drafter(target).eval()
    prompt = torch.randint(0, 500, (8,)).tolist()
    result = speculative_generate(target, drafter, prompt, DecodeSettings(10))
    assert result.output_ids == greedy(target, prompt, 10)


def test_both_decoders_stop_at_the_first_stop_token_inclusive():
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    prompt = torch.randint(0, 500, (9,)).tolist()
    full = greedy(target, prompt, 30)
    stop = full[7]
    expected = full[: full.index(stop) + 1]
    assert (
        plain_generate(target, prompt, DecodeSettings(30, stop_ids=frozenset([stop]))).output_ids == expected
    )
    result = speculative_generate(target, drafter, prompt, DecodeSettings(30, stop_ids=frozenset([stop])))
    assert result.output_ids == expected and sum(result.acceptance_lengths) == len(expected) - 1


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
@torch.no_grad()
def test_decoding_drafts_are_what_training_scores(layer_types):
    """At any anchor, both decoders draft exactly the training forward's argmax over the same
    context: the accuracy training measures (and tau_sim built on it) is the acceptance decoding
    gets. Decoding writes features past the anchor too (rejected drafts): they must stay unseen.
    A sliding layer (window 8 here, shorter than most contexts) windows decoding as training."""
    from dflash.decoding.static_drafter import StaticCacheDrafter
    from dflash.step.blocks import layer_masks

    target = tiny_target()
    drafter = tiny_drafter(target, layer_types=layer_types, sliding_window=8 if layer_types else None).eval()
    torch.manual_seed(4)
    ids = torch.randint(0, 500, (1, 40))
    features = target(ids).features
    block_size = drafter.block_size
    static = StaticCacheDrafter(drafter, target, max_len=64)
    static.write(features, torch.arange(40)[None])
    for anchor in (1, 6, 17, 39):
        block_ids = torch.full((1, block_size), drafter.mask_token_id)
        block_ids[0, 0] = ids[0, anchor]
        positions = (anchor + torch.arange(block_size))[None]
        mask = layer_masks(torch.tensor([[anchor]]), torch.tensor([[True]]), 40, block_size, drafter.windows)
        hidden = drafter(features, target.embed_tokens(block_ids), positions, mask)
        trained = target.lm_head(hidden)[0, 1:].argmax(-1).tolist()
        context = DrafterContext(drafter)
        context.extend(features[:, :anchor])
        assert context.draft(target, int(ids[0, anchor])) == trained, anchor
        drafted = static.draft(ids[0, anchor : anchor + 1], torch.tensor([anchor]), kv_len=48)
        assert drafted.tolist() == trained, anchor


def test_a_sliding_window_target_decodes_past_its_window_with_rejected_drafts():
    """Mistral with a sliding window: transformers' sliding cache cannot be cropped once it is
    full ("crop was called ... sliding window size was already reached"); rejected drafts past
    the window must still roll back, with the output the full recomputation gives."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.target.model import FrozenTarget
    from tests.conftest import TINY_ARCH

    torch.manual_seed(0)
    config = AutoConfig.for_model("mistral", **{**TINY_ARCH, "sliding_window": 8})
    target = FrozenTarget(AutoModelForCausalLM.from_config(config).eval(), [1, 3])
    drafter = tiny_drafter(target).eval()
    prompt = torch.randint(0, 500, (12,)).tolist()
    result = speculative_generate(target, drafter, prompt, DecodeSettings(24))
    assert result.output_ids == greedy(target, prompt, 24, cached=False)
    assert any(n < drafter.block_size for n in result.acceptance_lengths)  # drafts were rejected
