"""eval.decode_streams: prompts speculatively decoded side by side, one static decoder each, give
each prompt the outcome of decoding it alone (dflash.decoding.side_by_side)."""

from __future__ import annotations

import pytest
import torch

from dflash.decoding.engine import StaticDecoder
from dflash.decoding.settings import DecodeSettings
from dflash.decoding.side_by_side import SideBySideDecoders
from tests.test_dflash2_decoding import tiny_dflash2
from tests.test_dflash_rules import tiny_drafter, tiny_target
from tests.test_dspark import tiny_dspark

DRAFTERS = {"dflash": tiny_drafter, "dspark": tiny_dspark, "dflash2": tiny_dflash2}


def decoders(target, drafter, count: int) -> list[StaticDecoder]:
    return [StaticDecoder(target, drafter, max_len=80, graphs=False, kv_bucket=16) for _ in range(count)]


@pytest.mark.parametrize("variant", sorted(DRAFTERS))
@pytest.mark.parametrize(("temperature", "sampled_drafts"), [(0.0, False), (1.0, True)])
def test_each_prompt_decoded_side_by_side_is_decoded_as_alone(variant, temperature, sampled_drafts):
    """Three prompts of different lengths, each with its own seed (at temperature 1 the target's
    samples and a DSpark or DFlash2 drafter's sampled drafts follow it), one meeting a stop token:
    every DecodeResult field (tokens, acceptance lengths, accepted drafts, the confidence head's
    and the selector's records) equals a lone decoder's."""
    torch.set_num_threads(1)
    target = tiny_target()
    drafter = DRAFTERS[variant](target)
    torch.manual_seed(5)
    prompts = [torch.randint(0, 480, (length,)).tolist() for length in (7, 19, 12)]
    seeds = [11, 12, 13]
    alone = decoders(target, drafter, 1)[0]
    free_run = alone.speculative(
        prompts[2], DecodeSettings(24, temperature=temperature, seed=seeds[2]), sampled_drafts=sampled_drafts
    )
    stop = frozenset([free_run.output_ids[6]])
    settings = [DecodeSettings(24, temperature=temperature, seed=seed, stop_ids=stop) for seed in seeds]
    expected = [
        alone.speculative(prompt, each, sampled_drafts=sampled_drafts)
        for prompt, each in zip(prompts, settings)
    ]
    assert len(expected[2].output_ids) <= 7  # prompt 2 stops at its token
    side_by_side = SideBySideDecoders(decoders(target, drafter, 3), sampled_drafts=sampled_drafts)
    assert side_by_side.speculative(prompts, settings) == expected
    # Fewer prompts than decoders, in another order: each still its own outcome.
    assert side_by_side.speculative(prompts[::-1][:2], settings[::-1][:2]) == expected[::-1][:2]


def test_a_failure_in_one_decoding_thread_reaches_the_caller_with_its_message():
    torch.set_num_threads(1)
    target = tiny_target()
    side_by_side = SideBySideDecoders(decoders(target, tiny_drafter(target), 2))
    broken = side_by_side.decoders[1]

    def fail(*args, **kwargs):
        raise RuntimeError("decoder 1 broke")

    broken.speculative = fail
    with pytest.raises(RuntimeError, match="decoder 1 broke"):
        side_by_side.speculative(
            [[1, 2, 3], [4, 5, 6]], [DecodeSettings(4, seed=0), DecodeSettings(4, seed=1)]
        )
    with pytest.raises(ValueError, match="3 prompts and 3 settings for 2 decoders"):
        side_by_side.speculative([[1]] * 3, [DecodeSettings(4)] * 3)
    with pytest.raises(ValueError, match="2 prompts and 1 settings for 2 decoders"):
        side_by_side.speculative([[1], [2]], [DecodeSettings(4)])
