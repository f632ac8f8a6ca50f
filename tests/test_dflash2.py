"""variant=dflash2 (docs/ARCHITECTURE.md §1, DFlash2): the block-local convolutions against their
formula and at identity, the selector's scores and K-way loss (with and without gold injection)
against the formulas written out by hand, the fused chunked loss against the reference path,
the figures, training end to end and the config's refusals."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.dflash2 import DFlash2Drafter, GroupedDynamicConv, add_dflash2_fields
from dflash.drafters.drafter_class import drafter_from_config
from dflash.drafters.dspark import DSparkDrafter
from dflash.export.zlab import load_drafter
from dflash.step.blocks import layer_masks
from dflash.step.dflash2_loss import dflash2_loss
from dflash.step.loss import objective_figures
from dflash.step.metrics import StepMetrics
from dflash.step.variant import DFlash2Variant
from dflash.train import train
from tests.test_dflash_rules import blocks_for, tiny_drafter_config
from tests.test_dspark import tiny_target

BLOCK = 4


def tiny_configs(target, *, top_k: int = 4, rank: int = 8, kernel: int = 2):
    base = tiny_drafter_config(target, BLOCK)
    dflash2 = add_dflash2_fields(
        copy.deepcopy(base),
        conv_kernel_size=kernel,
        conv_group_size=16,
        selector_rank=rank,
        selector_top_k=top_k,
    )
    return base, dflash2


def tiny_dflash2(target, *, scale: float = 0.3, **shape) -> DFlash2Drafter:
    """A DFlash2 drafter whose convolutions and selector are far from their init, so every term
    and gradient counts."""
    torch.manual_seed(1)
    drafter = DFlash2Drafter(tiny_configs(target, **shape)[1])
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "conv" in name or name.startswith("candidate_selector."):
                param.add_(torch.randn_like(param) * scale)
    return drafter


@pytest.mark.parametrize(
    "variant, needs",
    [
        (DFlash2Drafter, "a DFlash2 drafter config needs dflash_config.selector_top_k (add_dflash2_fields)"),
        (
            DSparkDrafter,
            "a DSpark drafter config needs markov_rank (dflash.drafters.dspark.add_dspark_fields)",
        ),
    ],
)
def test_a_variant_refuses_a_config_without_its_fields_by_naming_them(variant, needs):
    """The backbone asks the variant whether the config describes it (`describes`), and the
    refusal names the fields it lacks, before any layer is built."""
    with pytest.raises(ValueError) as refused:
        variant(tiny_configs(tiny_target())[0])
    assert str(refused.value) == needs


def dflash2_blocks(ids, loss_mask, *, num_anchors=8, gamma=4.0):
    return blocks_for(
        ids, loss_mask, block_size=BLOCK, num_anchors=num_anchors, gamma=gamma, with_prev_ids=True
    )


# -- blocks -------------------------------------------------------------------------------------


def test_blocks_carry_each_labels_true_previous_token():
    """Position k of anchor a predicts ids[a + k] (DFlash's labels) and its selector is conditioned
    on ids[a + k - 1]: the anchor for k = 1."""
    ids = torch.arange(100, 120)[None]
    blocks = dflash2_blocks(ids, torch.ones(1, 20), num_anchors=3)
    for j, a in enumerate(blocks.anchors[0].tolist()):
        rows = slice(BLOCK * j, BLOCK * (j + 1))
        assert blocks.labels[0, rows].tolist()[1:] == [100 + a + k for k in range(1, BLOCK)]
        assert blocks.prev_ids[0, rows].tolist()[1:] == [100 + a + k - 1 for k in range(1, BLOCK)]
    assert blocks.final_positions is None


# -- convolutions --------------------------------------------------------------------------------


def conv_by_hand(conv: GroupedDynamicConv, x, y, side: int) -> torch.Tensor:
    """out[i, c] = sum_t (base[side, t, c] + (P x)[i, side, t, c // group]) * y[i - t, c], taps before
    the block's first position read zero."""
    bsz, q_len, hidden = y.shape
    dynamic = (x @ conv.kernel_projection.weight.T).view(bsz, q_len, 2, conv.kernel_size, conv.groups)
    out = torch.zeros_like(y)
    for b in range(bsz):
        for i in range(q_len):
            for t in range(conv.kernel_size):
                if i % conv.block_size < t:
                    continue
                for c in range(hidden):
                    coefficient = conv.base_kernel[side, t, c] + dynamic[b, i, side, t, c // conv.group_size]
                    out[b, i, c] += coefficient * y[b, i - t, c]
    return out


@pytest.mark.parametrize("kernel", [2, 3])
def test_the_convolution_follows_its_formula_and_never_crosses_a_block(kernel):
    torch.manual_seed(0)
    conv = GroupedDynamicConv(hidden_size=8, kernel_size=kernel, group_size=4, block_size=BLOCK)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x, y = torch.randn(2, 3 * BLOCK, 8), torch.randn(2, 3 * BLOCK, 8)
    prepared, out_taps = conv.prepare(x)
    torch.testing.assert_close(prepared, conv_by_hand(conv, x, x, side=0))
    torch.testing.assert_close(conv.finish(y, out_taps), conv_by_hand(conv, x, y, side=1))
    # Changing one block's inputs leaves every other block's outputs exactly as they were.
    changed = y.clone()
    changed[:, BLOCK : 2 * BLOCK] += 1.0
    before, after = conv.finish(y, out_taps), conv.finish(changed, out_taps)
    assert torch.equal(before[:, :BLOCK], after[:, :BLOCK]) and torch.equal(
        before[:, 2 * BLOCK :], after[:, 2 * BLOCK :]
    )


@pytest.mark.parametrize("kernel", [1, 2, 3])
def test_the_convolutions_backward_keeps_only_its_inputs_and_equals_autograds(kernel):
    """`_BlockConvolve` recomputes each tap in its backward: its gradients (input, dynamic taps,
    base kernel) equal autograd's through the reference, and match finite differences."""
    from dflash.drafters.dflash2 import _BlockConvolve, block_convolve

    torch.manual_seed(0)
    y = torch.randn(2, 3 * BLOCK, 8, dtype=torch.float64, requires_grad=True)
    dynamic = torch.randn(2, 3 * BLOCK, kernel, 2, dtype=torch.float64, requires_grad=True)
    base = torch.randn(kernel, 8, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(2, 3 * BLOCK, 8, dtype=torch.float64)
    fast = _BlockConvolve.apply(y, dynamic, base, BLOCK)
    reference = block_convolve(y, dynamic, base, block_size=BLOCK)
    torch.testing.assert_close(fast, reference)
    fast_grads = torch.autograd.grad(fast, (y, dynamic, base), grad_out)
    reference_grads = torch.autograd.grad(reference, (y, dynamic, base), grad_out)
    for got, want in zip(fast_grads, reference_grads):
        torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(lambda *a: _BlockConvolve.apply(*a, BLOCK), (y, dynamic, base))


def test_a_fresh_dflash2_is_the_dflash_of_the_same_seed_and_learns_its_convolutions():
    """Same init seed: the same backbone bit for bit; identity convolutions: the same hidden
    states; and the convolutions' parameters get a gradient at once."""
    target = tiny_target(final_state=False)
    base, config = tiny_configs(target)
    torch.manual_seed(1)
    dflash = DFlashDrafter(base)
    torch.manual_seed(1)
    dflash2 = DFlash2Drafter(config)
    state = dflash2.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in dflash.state_dict().items())
    features = torch.randn(2, 12, 2 * 64)
    anchors, valid = torch.tensor([[2, 6], [3, 7]]), torch.ones(2, 2, dtype=torch.bool)
    positions = (anchors[:, :, None] + torch.arange(BLOCK)).reshape(2, -1)
    embeddings = torch.randn(2, 2 * BLOCK, 64)
    masks = layer_masks(anchors, valid, 12, BLOCK, dflash.windows)
    hidden = dflash2(features, embeddings, positions, masks)
    assert torch.equal(hidden, dflash(features, embeddings, positions, masks))
    hidden.square().sum().backward()
    for layer in dflash2.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            assert (
                conv.base_kernel.grad.abs().sum() > 0 and conv.kernel_projection.weight.grad.abs().sum() > 0
            )


def test_checkpoint_names_and_shapes_are_the_released_ones():
    """z-lab/dflash tests/fixtures/dflash2-safetensors-header.json: base_kernel [2, k, H],
    kernel_projection [2 k G, H], codebooks [V, r] without `.weight`, hidden_projection [r, H]."""
    target = tiny_target(final_state=False)
    shapes = {name: tuple(t.shape) for name, t in tiny_dflash2(target, kernel=3).state_dict().items()}
    groups = 64 // 16
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 3, 64)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 3 * groups, 64)
    assert shapes["candidate_selector.predecessor_codebook"] == (512, 8)
    assert shapes["candidate_selector.successor_codebook"] == (512, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, 64)
    assert isinstance(drafter_from_config(tiny_configs(target)[1]), DFlash2Drafter)


# -- the selector's loss --------------------------------------------------------------------------


def loss_inputs(seed: int = 0, top_k: int = 4):
    target = tiny_target(final_state=False)
    drafter = tiny_dflash2(target, top_k=top_k)
    torch.manual_seed(seed)
    ids = torch.randint(0, 500, (2, 18))
    blocks = dflash2_blocks(ids, torch.ones(2, 18), num_anchors=3)
    hidden = torch.randn(2, blocks.labels.shape[1], 64)
    # Every other position points at its label's head row: the label ranks high there, so the
    # top-K holds it at some positions and misses it at others.
    rows = target.lm_head.weight[blocks.labels[:, ::2]]
    hidden[:, ::2] = 3.0 * rows / rows.norm(dim=-1, keepdim=True) + 0.1 * hidden[:, ::2]
    return target, drafter, blocks, hidden.requires_grad_(True)


def selector_by_hand(target, drafter, blocks, hidden, alpha):
    """The numerator, written out position by position: CE over the vocabulary plus alpha x the
    K-way CE over the sorted top-K, the label put in the last slot when the top-K misses it."""
    selector = drafter.candidate_selector
    numerator, injected = 0.0, 0
    for b in range(blocks.labels.shape[0]):
        for q in range(blocks.labels.shape[1]):
            if not blocks.valid[b, q]:
                continue
            h, label, prev = hidden[b, q], int(blocks.labels[b, q]), int(blocks.prev_ids[b, q])
            logits = target.lm_head(h).float()
            ce = torch.logsumexp(logits, 0) - logits[label]
            values, ids = torch.topk(logits, selector.top_k)
            ids = ids.tolist()
            if label not in ids:
                ids[-1], injected = label, injected + 1
            query = selector.predecessor_codebook[prev] * (selector.hidden_projection.weight @ h)
            scores = torch.stack([logits[c] + query @ selector.successor_codebook[c] for c in ids])
            sel = torch.logsumexp(scores, 0) - scores[ids.index(label)]
            numerator = numerator + blocks.weights[b, q] * (ce + alpha * sel)
    return numerator, injected


@pytest.mark.parametrize("top_k", [1, 3, 40])
def test_the_loss_equals_its_formula_with_and_without_gold_injection(top_k):
    """K=1: the top-K nearly always misses (injection); K=40: rarely; both happen at K=3."""
    target, drafter, blocks, hidden = loss_inputs(top_k=top_k)
    stats = dflash2_loss(hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, selector_alpha=0.7)
    expected, injected = selector_by_hand(target, drafter, blocks, hidden, alpha=0.7)
    torch.testing.assert_close(stats.weighted_ce, expected, rtol=1e-5, atol=1e-5)
    supervised = int(blocks.valid.sum())
    assert int(stats.candidate_hits) == supervised - injected
    if top_k == 3:
        assert 0 < injected < supervised  # both cases in one batch
    # The selector's gradient reaches the backbone's hidden states and all three selector tensors
    # (with one candidate its K-way CE is log 1 = 0: nothing to learn).
    stats.weighted_ce.backward()
    assert hidden.grad.abs().sum() > 0
    selector_learns = [bool(p.grad.abs().sum() > 0) for p in drafter.candidate_selector.parameters()]
    assert selector_learns == [top_k > 1] * 3


def test_alpha_zero_is_dflash_loss_and_the_selector_gets_no_gradient():
    from dflash.step.loss import draft_loss

    target, drafter, blocks, hidden = loss_inputs()
    stats = dflash2_loss(hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, selector_alpha=0.0)
    plain = draft_loss(hidden, target.lm_head, blocks)
    torch.testing.assert_close(stats.weighted_ce, plain.weighted_ce)
    torch.testing.assert_close(stats.unary_correct, plain.correct)
    stats.weighted_ce.backward()
    assert all(p.grad is None or not p.grad.any() for p in drafter.candidate_selector.parameters())


@pytest.mark.parametrize("chunk", [5, 1000])
def test_fused_chunked_loss_equals_the_reference_path(chunk):
    """The same numerator, sums and gradients (hidden states and the selector's tensors) as every
    logit through autograd; the fused path routes the top-K values' and the label logit's
    gradients through the head rows they read."""
    results = []
    for logits_chunk in (0, chunk):
        target, drafter, blocks, hidden = loss_inputs(top_k=3)
        stats = dflash2_loss(
            hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, selector_alpha=1.0,
            logits_chunk=logits_chunk,
        )  # fmt: skip
        stats.weighted_ce.backward()
        grads = {"hidden": hidden.grad.clone()}
        grads.update({n: p.grad.clone() for n, p in drafter.candidate_selector.named_parameters()})
        results.append((stats, grads))
    (ref, ref_grads), (fused, fused_grads) = results
    for name in (
        "weighted_ce", "ce", "selector_ce", "candidate_hits", "candidate_mass", "selector_changed", "correct",
        "unary_correct", "accepted", "unary_accepted", "oracle_accepted", "rounds",
    ):  # fmt: skip
        torch.testing.assert_close(getattr(fused, name), getattr(ref, name), rtol=1e-5, atol=1e-5, msg=name)
    for name in ref_grads:
        torch.testing.assert_close(fused_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_figures_read_the_sums_the_step_adds():
    """recall, the oracle bounding the unary argmax and the selector, and changed picks counted
    against the unary argmax (index 0 of the sorted candidates)."""
    target, drafter, blocks, hidden = loss_inputs(top_k=3)
    stats = dflash2_loss(hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, selector_alpha=1.0)
    metrics = StepMetrics(BLOCK, num_buckets=1, device=torch.device("cpu"), variant=DFlash2Variant())
    from tests.conftest import one_sample_batch

    metrics.add(stats, torch.tensor(1.0), one_sample_batch(), anchors=6)
    figures = objective_figures(metrics.publish(end_step=1, lr=0.0).sums(), metrics.variant)
    supervised = float(blocks.valid.sum())
    assert figures["candidate_recall"] == pytest.approx(float(stats.candidate_hits) / supervised)
    assert 1.0 <= figures["unary_tau_block"] <= figures["oracle_tau_block"]
    assert figures["tau_block"] <= figures["oracle_tau_block"]
    assert 0.0 < figures["selector_changed"] < 1.0  # the randomised selector does change picks
    assert figures["loss"] == pytest.approx(figures["ce"] + figures["selector_ce"], rel=1e-5)


def test_a_released_drafters_logit_scaling_is_refused_for_training():
    target, drafter, blocks, hidden = loss_inputs()
    drafter.settings["final_logit_softcapping"] = 20.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        dflash2_loss(hidden, lm_head=target.lm_head, drafter=drafter, blocks=blocks, selector_alpha=1.0)


# -- training -----------------------------------------------------------------------------------

DFLASH2 = ["variant=dflash2", "variant.selector_rank=16", "variant.selector_top_k=8"]
FIGURES = ("ce", "selector_ce", "candidate_recall", "candidate_mass", "unary_tau_decode", "oracle_tau_decode")


def test_variant_dflash2_trains_end_to_end_and_reports_its_figures(make_cfg):
    cfg = make_cfg(DFLASH2 + ["train.total_steps=4", "logger.every_steps=2", "data.val_samples=16"])
    summary = train(cfg)
    assert summary["steps"] == 4 and summary["eval/lossless_frac"] == 1.0
    for name in FIGURES:
        assert math.isfinite(summary[f"train/{name}"]) and math.isfinite(summary[f"val/{name}"]), name
    rows = [
        json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    train_row = next(row for row in rows if "train/loss" in row)
    assert train_row["train/loss"] == pytest.approx(
        train_row["train/ce"] + train_row["train/selector_ce"], rel=1e-5
    )
    checkpoint = load_drafter(Path(summary["checkpoint"]))
    assert isinstance(checkpoint, DFlash2Drafter)
    assert checkpoint.config.dflash_config["selector_top_k"] == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["variant.conv_group_size=7"], r"variant.conv_group_size=7 must divide the hidden size \(64\)"),
        (["variant.conv_kernel_size=9"], r"variant.conv_kernel_size=9: must be in 1..block_size"),
        (["variant.selector_top_k=0"], "variant.selector_top_k=0: must be >= 1"),
        (["variant.selector_alpha=-1"], "variant.selector_alpha=-1.0: must be >= 0"),
    ],
)
def test_bad_dflash2_settings_are_refused_naming_the_key(make_cfg, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(make_cfg(["variant=dflash2", *overrides]))
