"""Each noise mode has its scheduled effect at a step inside the warmup (a schedule that silently
does nothing is a known bug of the system we replace)."""

from __future__ import annotations

import pytest
import torch

from dflash.config.schema import COMPONENT_OPTIONS
from dflash.step.build import build_noise
from dflash.step.noise import NoiseSchedule
from tests.test_dflash_rules import MASK_ID, blocks_for, tiny_drafter, tiny_target


def schedule(kind: str, **kw) -> NoiseSchedule:
    """noise=<kind>'s schedule, built from its option schema as a run builds it."""
    return build_noise(COMPONENT_OPTIONS["noise"][kind](**kw))


def test_none_changes_nothing_at_any_step():
    """noise=none trains the paper's way for the whole run: at every step every non-anchor block
    position is MASK and the drafter sees the target's features unchanged."""
    noise = schedule("none")
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.randint(0, 500, (4, 64))
    mask = torch.ones(4, 64)
    features = target.features(ids)
    clean = drafter.context(features)
    for step in (0, 1, 250, 10_000, 10**7):
        blocks = blocks_for(ids, mask, block_size=8, num_anchors=16, keep=noise.keep_fraction(step))
        in_range = blocks.positions < 64
        non_anchor = (
            (torch.arange(blocks.block_ids.shape[1]) % 8 != 0)
            & in_range
            & blocks.anchor_valid.repeat_interleave(8, 1)
        )
        assert non_anchor.any() and (blocks.block_ids[non_anchor] == MASK_ID).all(), step
        generator = torch.Generator().manual_seed(step)
        assert torch.equal(drafter.context(features, noise.feature_std(step), generator), clean), step


def test_mask_ramp_keeps_the_scheduled_share_of_true_tokens_without_loss():
    noise = schedule("mask_ramp", start=0.6, warmup_steps=1000)
    assert noise.keep_fraction(0) == pytest.approx(0.6)
    assert noise.keep_fraction(500) == pytest.approx(0.3)
    assert noise.keep_fraction(1000) == 0.0 and noise.keep_fraction(5000) == 0.0

    ids = torch.randint(0, 500, (64, 128))
    mask = torch.ones(64, 128)
    blocks = blocks_for(ids, mask, block_size=8, num_anchors=32, keep=noise.keep_fraction(500))
    in_range = blocks.positions < 128
    non_anchor = (
        (torch.arange(blocks.block_ids.shape[1]) % 8 != 0)
        & in_range
        & blocks.anchor_valid.repeat_interleave(8, 1)
    )
    kept = (blocks.block_ids != MASK_ID) & non_anchor
    share = kept.sum() / non_anchor.sum()
    assert share.item() == pytest.approx(0.3, abs=0.02)  # measured at the mid-warmup step
    true_ids = torch.gather(ids, 1, blocks.positions.clamp(max=127))
    assert torch.equal(blocks.block_ids[kept], true_ids[kept])  # kept positions show the true token
    assert blocks.weights[kept].sum() == 0 and not blocks.valid[kept].any()  # ... and carry no loss

    done = blocks_for(ids, mask, block_size=8, num_anchors=32, keep=noise.keep_fraction(1000))
    assert ((done.block_ids != MASK_ID) & non_anchor).sum() == 0  # fully masked after warmup


def test_feature_noise_has_the_scheduled_std_and_reaches_the_loss():
    noise = schedule("feature", std=0.2, warmup_steps=100)
    assert noise.feature_std(0) == 0.0
    assert noise.feature_std(50) == pytest.approx(0.1)
    assert noise.feature_std(100) == pytest.approx(0.2) == noise.feature_std(1000)

    target = tiny_target()
    drafter = tiny_drafter(target)
    features = target.features(torch.randint(0, 500, (8, 64)))
    clean = drafter.context(features)
    gen = torch.Generator().manual_seed(0)
    noisy = drafter.context(features, noise.feature_std(50), gen)
    assert (noisy - clean).std().item() == pytest.approx(0.1, rel=0.05)
