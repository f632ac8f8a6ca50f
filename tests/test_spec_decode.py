"""Greedy speculative decoding: lossless whatever the drafter, and acceptance counted right."""

from __future__ import annotations

import torch

from dflash import spec_decode
from dflash.spec_decode import greedy_generate, speculative_generate
from tests.test_dflash_rules import tiny_drafter, tiny_target


def test_output_equals_plain_greedy_even_with_an_untrained_drafter():
    target, drafter = tiny_target(), None
    drafter = tiny_drafter(target).eval()
    prompt = torch.randint(0, 500, (12,)).tolist()
    result = speculative_generate(target, drafter, prompt, 20)
    assert result.output_ids == greedy_generate(target, prompt, 20)
    assert sum(result.acceptance_lengths) == 20 - 1  # the first token comes from the prefill
    assert all(1 <= n <= drafter.block_size for n in result.acceptance_lengths)


def test_a_perfect_drafter_is_accepted_whole_blocks(monkeypatch):
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    prompt = torch.randint(0, 500, (10,)).tolist()
    truth = greedy_generate(target, prompt, 40)

    def oracle(drafter_, target_, features, anchor_token):
        start = features.shape[1] + 1 - len(prompt)  # index in `truth` of the token after the anchor
        return truth[start : start + drafter_.block_size - 1]

    monkeypatch.setattr(spec_decode, "draft_block", oracle)
    result = speculative_generate(target, drafter, prompt, 40)
    assert result.output_ids == truth
    assert result.acceptance_lengths[:-1] == [drafter.block_size] * (len(result.acceptance_lengths) - 1)


def test_fp32_drafter_drives_a_bf16_target():
    """The GPU layout (bf16 target, fp32 master-weight drafter), exercised on CPU."""
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    target.model.to(torch.bfloat16)
    prompt = torch.randint(0, 500, (8,)).tolist()
    result = speculative_generate(target, drafter, prompt, 6)
    assert result.output_ids == greedy_generate(target, prompt, 6)
