"""loss=dpace (dflash/step/dpace.py): the D-PACE weights against the formula worked by hand, the
loss and its gradient against a position-by-position computation, training with DFlash and
DFlash2 on the tiny target, and its refusal with DSpark."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dflash.step.dflash2_loss import dflash2_loss
from dflash.step.dpace import DPaceLoss, dpace_weights
from dflash.step.loss import draft_loss
from dflash.train import train
from tests.test_cli import dflash
from tests.test_dflash2 import loss_inputs


def test_the_weights_follow_the_formula_worked_by_hand():
    """alpha 0.5, confidences 0.8, 0.2, 0.6: smoothed 0.9, 0.6, 0.8; survival 0.9, 0.54, 0.432;
    weights their suffix sums 1.872, 0.972, 0.432. An unsupervised position in the middle is 1
    in the products and 0 in the sums: survival 0.9, -, 0.72; weights 1.62, 0, 0.72. The anchor
    slot (DFlash's position 0, never supervised) gets 0 and changes nothing after it: 0.9, 0.6
    survive as 0.9, 0.54, weights 1.44, 0.54."""
    confidence = torch.tensor([[0.8, 0.2, 0.6], [0.8, 0.2, 0.6], [0.3, 0.8, 0.2]])
    valid = torch.tensor([[True, True, True], [True, False, True], [False, True, True]])
    expected = torch.tensor([[1.872, 0.972, 0.432], [1.62, 0.0, 0.72], [0.0, 1.44, 0.54]])
    torch.testing.assert_close(dpace_weights(confidence, valid, 0.5), expected)
    # alpha 1: every position's survival is 1, the weight counts the supervised positions from k on.
    torch.testing.assert_close(
        dpace_weights(confidence, valid, 1.0),
        torch.tensor([[3.0, 2.0, 1.0], [2.0, 0.0, 1.0], [0.0, 2.0, 1.0]]),
    )


def by_hand(lm_head, blocks, hidden, alpha):
    """sum_k w_k CE_k and sum_k w_k, block by block, position by position, w_k from the loop."""
    numerator, total = 0.0, 0.0
    per_block = blocks.labels.view(blocks.labels.shape[0], -1, blocks.block_size)
    for b in range(per_block.shape[0]):
        for a in range(per_block.shape[1]):
            rows = [a * blocks.block_size + k for k in range(blocks.block_size)]
            ce, smoothed = {}, {}
            for k, q in enumerate(rows):
                if blocks.valid[b, q]:
                    logits = lm_head(hidden[b, q]).float()
                    ce[k] = torch.logsumexp(logits, 0) - logits[int(blocks.labels[b, q])]
                    smoothed[k] = alpha + (1 - alpha) * math.exp(-float(ce[k].detach()))
            survival, product = {}, 1.0
            for k in range(blocks.block_size):
                product *= smoothed.get(k, 1.0)
                if k in ce:
                    survival[k] = product
            for k in ce:
                weight = sum(value for m, value in survival.items() if m >= k)
                numerator, total = numerator + weight * ce[k], total + weight
    return numerator, total


@pytest.mark.parametrize("logits_chunk", [0, 5])
def test_the_dflash_loss_and_its_gradient_are_the_formulas_with_detached_weights(logits_chunk):
    """The reference path and the fused one (chunks of 5 labelled rows) give the hand-computed
    numerator and weight, and the gradient of sum w CE with w held constant."""
    target, _, blocks, hidden = loss_inputs()
    loss = DPaceLoss(gamma=4.0, logits_chunk=logits_chunk, alpha=0.5)
    weighed = loss.weigh(hidden, target.lm_head, blocks)
    stats = draft_loss(hidden, target.lm_head, weighed, logits_chunk)
    numerator, total = by_hand(target.lm_head, blocks, hidden, alpha=0.5)
    torch.testing.assert_close(stats.weighted_ce, numerator, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        stats.weight, torch.tensor(total, dtype=stats.weight.dtype), rtol=1e-5, atol=1e-5
    )
    assert not weighed.weights.requires_grad
    (grad,) = torch.autograd.grad(stats.weighted_ce, hidden)
    (expected,) = torch.autograd.grad(by_hand_detached(target.lm_head, weighed, hidden), hidden)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def by_hand_detached(lm_head, blocks, hidden):
    logits = lm_head(hidden).float()
    ce = torch.logsumexp(logits, -1) - logits.gather(-1, blocks.labels[..., None]).squeeze(-1)
    return (ce * blocks.weights.detach()).sum()


def test_dflash2_scores_both_terms_with_the_dpace_weights():
    target, drafter, blocks, hidden = loss_inputs(top_k=3)
    weighed = DPaceLoss(gamma=4.0, alpha=0.5).weigh(hidden, target.lm_head, blocks)
    stats = dflash2_loss(hidden, lm_head=target.lm_head, drafter=drafter, blocks=weighed, selector_alpha=1.0)
    numerator, total = by_hand(target.lm_head, blocks, hidden, alpha=0.5)
    torch.testing.assert_close(stats.ce, numerator.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(float(stats.weight), total, rtol=1e-5, atol=1e-5)


def test_gamma_is_not_read():
    """The drafter options set loss.gamma; under D-PACE two values give the same weights."""
    target, _, blocks, hidden = loss_inputs()
    first, second = (
        DPaceLoss(gamma=gamma, alpha=0.5).weigh(hidden, target.lm_head, blocks).weights
        for gamma in (2.0, 9.0)
    )
    torch.testing.assert_close(first, second)
    assert torch.equal(DPaceLoss(gamma=2.0).position_weights(4), torch.tensor([0.0, 1.0, 1.0, 1.0]))


def read_losses(cfg) -> list[float]:
    rows = (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [row["train/loss"] for row in map(json.loads, rows) if "train/loss" in row]


@pytest.mark.parametrize(
    "variant",
    [["variant=dflash"], ["variant=dflash2", "variant.selector_rank=16", "variant.selector_top_k=8"]],
)
def test_dflash_and_dflash2_train_under_dpace(make_cfg, variant, monkeypatch):
    overrides = ["loss=dpace", "train.total_steps=24", "logger.every_steps=4", "optimizer.lr=3e-3"]
    cfg = make_cfg([*variant, *overrides, "data.val_samples=16"])
    # The steps weigh their positions by D-PACE (a run that fell back to the static weights
    # would train and converge as well).
    weighed = []
    weigh = DPaceLoss.weigh
    monkeypatch.setattr(
        DPaceLoss, "weigh", lambda self, *a, **k: weighed.append(self.alpha) or weigh(self, *a, **k)
    )
    summary = train(cfg)
    assert len(weighed) >= 24 and set(weighed) == {0.5}
    losses = read_losses(cfg)
    assert summary["steps"] == 24 and all(math.isfinite(value) for value in losses)
    assert math.isfinite(summary["val/loss"])  # the held-out split is scored under the same weights
    assert sum(losses[-2:]) < 0.95 * sum(losses[:2]), losses


@pytest.mark.parametrize("alpha", ["0", "1.5"])
def test_an_alpha_out_of_range_is_refused_naming_the_key(make_cfg, alpha):
    with pytest.raises(ValueError, match=rf"loss.alpha must be in \(0, 1\], got {float(alpha)}"):
        train(make_cfg(["loss=dpace", f"loss.alpha={alpha}"]))


@pytest.mark.parametrize("variant", ["dspark", "lilicorr"])
def test_dpace_with_a_variant_that_refuses_it_is_refused_before_any_weights_load(
    make_cfg, variant, monkeypatch
):
    from dflash.target.model import FrozenTarget

    monkeypatch.setattr(FrozenTarget, "from_config", lambda *args, **kwargs: pytest.fail("a model loaded"))
    with pytest.raises(ValueError, match=f"loss=dpace .* with variant={variant} use loss=default"):
        train(make_cfg([f"variant={variant}", "loss=dpace"]))


def test_each_variant_says_itself_whether_it_refuses_dpace():
    """The variants whose references train with the static decay only (DSpark, LiLiCorr) refuse
    loss=dpace from their `run_refusal`, the one hook for settings outside their node; the others
    train under it. A setting refused already (DSpark's kept positions under noise=mask_ramp)
    is still the one named."""
    from dflash.config.schema import DPaceLossConfig, MaskRampNoiseConfig, NoNoiseConfig
    from dflash.config.variant_schema import BUILT_IN_VARIANTS
    from dflash.step.variant_registry import registered_variants

    builtin = {variant.name: registered_variants()[variant.name] for variant in BUILT_IN_VARIANTS}
    refusals = {
        name: variant.run_refusal(variant=variant.options(), noise=NoNoiseConfig(), loss=DPaceLossConfig())
        for name, variant in builtin.items()
    }
    assert {name for name, refusal in refusals.items() if refusal} == {"dspark", "lilicorr"}
    assert all(f"with variant={name} use loss=default" in refusals[name] for name in ("dspark", "lilicorr"))
    dspark = builtin["dspark"]
    both = dspark.run_refusal(variant=dspark.options(), noise=MaskRampNoiseConfig(), loss=DPaceLossConfig())
    assert both.startswith("noise=mask_ramp is DFlash's")


@pytest.mark.slow
def test_dpace_with_dspark_is_one_line_and_exit_2(tmp_path):
    result = dflash(
        "train", "variant=dspark", "loss=dpace", "debug=fast", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "loss=dpace" in lines[0] and "variant=dspark" in lines[0], result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
