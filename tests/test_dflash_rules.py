"""Every rule of docs/ARCHITECTURE.md §1, tested directly (each one prevents a bug someone shipped)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from dflash.config.schema import DrafterConfig
from dflash.drafters.backbone import DFlashDrafter, drafter_config
from dflash.drafters.layer_ids import default_target_layer_ids
from dflash.step.blocks import (
    block_attention_mask,
    build_blocks,
    position_weights,
    sample_anchors,
    sample_rng,
)
from dflash.step.loss import block_acceptance, draft_loss, tau_from_accuracy, tau_from_rounds, tau_from_runs
from dflash.target.model import FrozenTarget
from tests.conftest import FAMILIES, one_sample_batch

MASK_ID = 511


def tiny_target() -> FrozenTarget:
    from transformers import AutoModelForCausalLM

    from tests.conftest import TINY_ARCH

    config = AutoConfig.for_model("qwen3", **TINY_ARCH)
    torch.manual_seed(0)
    return FrozenTarget(AutoModelForCausalLM.from_config(config), [1, 3])


def tiny_drafter_config(
    target: FrozenTarget,
    block_size: int = 4,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
):
    """A two-layer drafter's Qwen3Config for `target` (the variants add their fields to it);
    layer_types / sliding_window: drafter.layer_types and drafter.sliding_window."""
    cfg = DrafterConfig(
        name="t",
        num_layers=2,
        block_size=block_size,
        mask_token_id=MASK_ID,
        num_anchors=8,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    return drafter_config(cfg, target.config, target.layer_ids)


def tiny_drafter(
    target: FrozenTarget,
    block_size: int = 4,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
) -> DFlashDrafter:
    torch.manual_seed(1)
    return DFlashDrafter(tiny_drafter_config(target, block_size, layer_types, sliding_window))


def blocks_for(
    ids,
    loss_mask,
    *,
    block_size=4,
    num_anchors=8,
    gamma=4.0,
    epoch=0,
    sample_ids=None,
    keep=0.0,
    label_offset=0,
    with_prev_ids=False,
):
    """`build_blocks` over a tiny batch (a 1-D sequence is one sample); `label_offset` and
    `with_prev_ids` as a variant sets them (dflash/step/variant.py)."""
    ids = torch.as_tensor(ids)
    loss_mask = torch.as_tensor(loss_mask, dtype=torch.uint8)
    if ids.dim() == 1:
        ids, loss_mask = ids[None], loss_mask[None]
    lengths = torch.full((ids.shape[0],), ids.shape[1])
    return build_blocks(
        ids,
        loss_mask,
        lengths,
        sample_ids or list(range(ids.shape[0])),
        epoch=epoch,
        seed=0,
        block_size=block_size,
        num_anchors=num_anchors,
        mask_token_id=MASK_ID,
        weights=position_weights(block_size, gamma, label_offset),
        keep_fraction=keep,
        label_offset=label_offset,
        with_prev_ids=with_prev_ids,
    )


# -- context feature layers -------------------------------------------------------------------


def test_default_layer_ids_follow_the_design_formula():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(6, 2) == [1, 3]


def test_target_features_are_hidden_states_of_layer_id_plus_one():
    target = tiny_target()
    ids = torch.randint(0, 500, (2, 10))
    out = target.model(ids, output_hidden_states=True)
    expected = torch.cat([out.hidden_states[2], out.hidden_states[4]], dim=-1)  # layers 1 and 3
    torch.testing.assert_close(target.features(ids), expected)
    torch.testing.assert_close(target(ids).features, expected)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("layer_ids, runs", [([1, 3], 4), ([0], 1), ([2, 5], 6)])
def test_features_stop_at_the_deepest_feature_layer_and_equal_the_full_forward(
    model_type, layer_ids, runs, request
):
    """The feature stack runs layers 0..max(layer_ids) only (no final norm): the features are
    the full model's hidden states all the same, and the model itself is untouched."""
    from transformers import AutoModelForCausalLM

    directory = request.getfixturevalue(f"tiny_{model_type}_dir")
    model = AutoModelForCausalLM.from_pretrained(directory)
    ids = torch.randint(1, 500, (2, 11))
    with torch.no_grad():
        full = model(ids, output_hidden_states=True)
    target = FrozenTarget(model, layer_ids)
    assert target.feature_layers == runs
    layers = model.base_model.layers
    ran = [0] * len(layers)
    hooks = [
        layer.register_forward_hook(lambda *_, index=index: ran.__setitem__(index, ran[index] + 1))
        for index, layer in enumerate(layers)
    ]
    features = target.features(ids)
    for hook in hooks:
        hook.remove()
    assert ran == [1] * runs + [0] * (len(layers) - runs)  # the layers past the deepest never run
    expected = torch.cat([full.hidden_states[i + 1] for i in layer_ids], dim=-1)
    torch.testing.assert_close(features, expected, rtol=0, atol=0)
    after = target(ids)
    torch.testing.assert_close(after.logits, full.logits, rtol=0, atol=0)
    torch.testing.assert_close(after.features, expected, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_right_padding_leaves_real_token_features_unchanged(model_type, request):
    """Why FrozenTarget.features takes no padding mask: causal models never look ahead."""
    from transformers import AutoModelForCausalLM

    directory = request.getfixturevalue(f"tiny_{model_type}_dir")
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(directory), [1, 3])
    ids = torch.randint(1, 500, (1, 12))
    padded = torch.cat([ids, torch.zeros(1, 7, dtype=torch.int64)], dim=1)
    torch.testing.assert_close(target.features(padded)[:, :12], target.features(ids))


# -- anchors ----------------------------------------------------------------------------------


def test_anchors_need_loss_mask_at_p_and_p_plus_1():
    loss_mask = np.array([0, 0, 1, 1, 0, 1, 1, 1, 0])
    rng = sample_rng(0, 0, 0)
    assert sample_anchors(loss_mask, 100, rng).tolist() == [2, 5, 6]


def test_anchor_draw_is_per_sample_not_per_batch():
    ids = torch.arange(40).reshape(2, 20)
    mask = torch.ones(2, 20)
    alone = blocks_for(ids[1], mask[1], num_anchors=5, sample_ids=[7])
    batched = blocks_for(ids, mask, num_anchors=5, sample_ids=[3, 7])
    assert alone.anchors[0].tolist() == batched.anchors[1].tolist()
    next_epoch = blocks_for(ids[1], mask[1], num_anchors=5, sample_ids=[7], epoch=1)
    assert next_epoch.anchors[0].tolist() != alone.anchors[0].tolist()  # drawn afresh each epoch


def test_sample_without_anchor_is_masked_not_raised():
    ids = torch.arange(24).reshape(2, 12)
    mask = torch.zeros(2, 12)
    mask[0, 4:] = 1  # sample 1 has no supervised token at all
    blocks = blocks_for(ids, mask)
    assert blocks.anchor_valid[1].sum() == 0
    assert blocks.weights[1].sum() == 0 and not blocks.valid[1].any()
    all_empty = blocks_for(ids, torch.zeros(2, 12))
    assert all_empty.weights.sum() == 0


# -- blocks, labels, weights ------------------------------------------------------------------


def test_block_is_anchor_then_mask_and_labels_are_ids_at_a_plus_k():
    ids = torch.arange(100, 120)
    blocks = blocks_for(ids, torch.ones(20), block_size=4, num_anchors=3)
    for j, anchor in enumerate(blocks.anchors[0].tolist()):
        sl = slice(4 * j, 4 * j + 4)
        assert blocks.block_ids[0, sl].tolist() == [100 + anchor, MASK_ID, MASK_ID, MASK_ID]
        assert blocks.positions[0, sl].tolist() == [anchor + k for k in range(4)]
        expected = [0] + [100 + anchor + k if anchor + k < 20 else 0 for k in range(1, 4)]
        assert blocks.labels[0, sl].tolist() == expected  # no shift: position k predicts a + k


def test_loss_weights_decay_from_position_one_and_skip_the_anchor():
    w = position_weights(5, gamma=7.0)
    assert w[0] == 0
    assert torch.allclose(w[1:], torch.tensor([math.exp(-(k - 1) / 7.0) for k in range(1, 5)]))


def test_weights_zero_past_the_end_and_on_unsupervised_tokens():
    ids = torch.arange(10)
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0, 1, 1])
    blocks = blocks_for(ids, mask, block_size=4, num_anchors=10)
    positions, weights = blocks.positions[0], blocks.weights[0]
    for q in range(len(positions)):
        pos = int(positions[q])
        supervised = pos < 10 and bool(mask[pos]) and q % 4 != 0
        assert (weights[q] > 0) == supervised


# -- attention mask ---------------------------------------------------------------------------


def test_mask_context_strictly_before_anchor_bidirectional_block_nothing_across():
    anchors = torch.tensor([[3, 6]])
    valid = torch.tensor([[True, True]])
    mask = block_attention_mask(anchors, valid, ctx_len=10, block_size=3)[0]  # [6, 10 + 6]
    ctx, blk = mask[:, :10], mask[:, 10:]
    assert ctx[:3].tolist() == [[i < 3 for i in range(10)]] * 3  # i < a strictly: not the anchor itself
    assert ctx[3:].tolist() == [[i < 6 for i in range(10)]] * 3
    expected_blocks = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool()
    assert torch.equal(blk, expected_blocks)  # full square inside a block: no causal mask


def test_padding_blocks_see_no_context_and_no_other_block():
    mask = block_attention_mask(
        torch.tensor([[4, 0]]), torch.tensor([[True, False]]), ctx_len=8, block_size=2
    )[0]
    assert not mask[2:, :8].any()
    assert not mask[2:, 8:10].any() and not mask[:2, 10:].any()


def test_drafter_output_respects_the_mask_rules():
    """Behaviour, not just the mask tensor: what a block may and may not depend on."""
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    ids = torch.randint(0, 500, (1, 24))
    blocks = blocks_for(ids[0], torch.ones(24), block_size=4, num_anchors=2)
    a0 = int(blocks.anchors[0, 0])

    def run(features, block_ids):
        mask = block_attention_mask(blocks.anchors, blocks.anchor_valid, features.shape[1], 4)
        return drafter(features, target.embed_tokens(block_ids), blocks.positions, mask)

    features = target.features(ids)
    base = run(features, blocks.block_ids)
    later = features.clone()
    later[:, a0:] += 1.0  # the anchor's own position and after: invisible to block 0
    assert torch.allclose(run(later, blocks.block_ids)[:, :4], base[:, :4])
    before = features.clone()
    before[:, a0 - 1] += 1.0
    assert not torch.allclose(run(before, blocks.block_ids)[:, :4], base[:, :4])
    other = blocks.block_ids.clone()
    other[0, 4] = (other[0, 4] + 1) % 500  # block 1's anchor: invisible to block 0
    assert torch.allclose(run(features, other)[:, :4], base[:, :4])
    own = blocks.block_ids.clone()
    own[0, 3] = 7  # last position of block 0 changes its first positions too (bidirectional)
    assert not torch.allclose(run(features, own)[:, :1], base[:, :1])


# -- loss, accuracy, tau ----------------------------------------------------------------------


def test_loss_is_weighted_mean_and_reduces_across_replicas_once():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.randint(0, 500, (2, 16))
    mask = torch.ones(2, 16)
    mask[1, :14] = 0  # sample 1 has a single anchor: a "short" replica
    blocks = blocks_for(ids, mask, num_anchors=4)
    features = target.features(ids)

    def stats_for(rows):
        sub = type(blocks)(
            **{
                k: getattr(blocks, k)[rows]
                for k in ("block_ids", "positions", "labels", "weights", "valid", "anchors", "anchor_valid")
            },
            loss_rows=blocks.valid[rows].flatten().nonzero().flatten(),
            block_size=4,
        )
        att = block_attention_mask(sub.anchors, sub.anchor_valid, 16, 4)
        hidden = drafter(features[rows], target.embed_tokens(sub.block_ids), sub.positions, att)
        return draft_loss(hidden, target.lm_head, sub), hidden

    full, hidden = stats_for(slice(0, 2))
    logits = target.lm_head(hidden)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), reduction="none")
    manual = (ce * blocks.weights.flatten()).sum() / blocks.weights.sum()
    torch.testing.assert_close(full.loss(), manual)
    a, _ = stats_for(slice(0, 1))
    b, _ = stats_for(slice(1, 2))
    combined = (a.weighted_ce + b.weighted_ce) / (a.weight + b.weight)
    torch.testing.assert_close(combined, full.loss(), rtol=1e-5, atol=1e-6)
    assert not torch.isclose((a.loss() + b.loss()) / 2, full.loss())  # mean of means is the bug


@pytest.mark.parametrize("unlabelled", [False, True])
def test_fused_lm_head_loss_gives_the_reference_loss_accuracy_and_gradients(unlabelled):
    """unlabelled: positions the fused loss skips besides each block's anchor (`loss_rows`): a
    sample with few supervised positions (padding blocks, blocks running into unsupervised
    tokens) and mask_ramp's kept tokens."""
    target = tiny_target()
    ids = torch.randint(0, 500, (2, 24))
    loss_mask = torch.ones(2, 24)
    if unlabelled:
        loss_mask[1, :19] = 0  # 4 anchor candidates for 6 blocks
        loss_mask[0, 10:13] = 0
    blocks = blocks_for(ids, loss_mask, num_anchors=6, keep=0.3 if unlabelled else 0.0)  # Q = 24 per sample
    if unlabelled:
        assert not blocks.anchor_valid.all() and len(blocks.loss_rows) < blocks.valid.numel() * 3 // 4
    assert torch.equal(blocks.loss_rows, blocks.valid.flatten().nonzero().flatten())
    att = block_attention_mask(blocks.anchors, blocks.anchor_valid, 24, 4)
    features, emb = target.features(ids), target.embed_tokens(blocks.block_ids)
    results = []
    # 0: the reference; 5 divides neither Q nor the blocks; compiled: the CUDA default's kernel
    for chunk, compiled in ((0, False), (5, False), (5, True), (48, False), (1000, False)):
        drafter = tiny_drafter(target)
        hidden = drafter(features, emb, blocks.positions, att)
        stats = draft_loss(hidden, target.lm_head, blocks, logits_chunk=chunk, compiled=compiled)
        stats.loss().backward()
        results.append((stats, [p.grad.clone() for p in drafter.parameters()]))
    (reference, ref_grads), *others = results
    for stats, grads in others:
        torch.testing.assert_close(stats.weighted_ce, reference.weighted_ce)
        assert torch.equal(stats.correct, reference.correct) and torch.equal(stats.counted, reference.counted)
        for grad, ref in zip(grads, ref_grads):
            torch.testing.assert_close(grad, ref)


@pytest.mark.parametrize("logits_chunk", [0, 5])  # the reference, and the fused loss with no row to run
def test_empty_batch_gives_zero_loss_and_finite_zero_grads(logits_chunk):
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.randint(0, 500, (2, 12))
    blocks = blocks_for(ids, torch.zeros(2, 12))
    att = block_attention_mask(blocks.anchors, blocks.anchor_valid, 12, 4)
    hidden = drafter(target.features(ids), target.embed_tokens(blocks.block_ids), blocks.positions, att)
    loss = draft_loss(hidden, target.lm_head, blocks, logits_chunk=logits_chunk).loss()
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() == 0 for p in drafter.parameters())


def test_accuracy_is_unweighted_per_position():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.randint(0, 500, (1, 20))
    blocks = blocks_for(ids[0], torch.ones(20), num_anchors=4)
    att = block_attention_mask(blocks.anchors, blocks.anchor_valid, 20, 4)
    hidden = drafter(target.features(ids), target.embed_tokens(blocks.block_ids), blocks.positions, att)
    stats = draft_loss(hidden, target.lm_head, blocks)
    pred = target.lm_head(hidden).argmax(-1)
    for k in range(1, 4):
        cols = slice(k, None, 4)
        valid = blocks.valid[0, cols]
        assert stats.counted[k] == valid.sum()
        assert stats.correct[k] == ((pred[0, cols] == blocks.labels[0, cols]) & valid).sum()
    assert stats.counted[0] == 0


def test_tau_sim_is_one_plus_sum_of_prefix_products():
    assert tau_from_accuracy([float("nan"), 0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert tau_from_accuracy([float("nan"), 1.0, 1.0, 1.0]) == 4.0
    assert tau_from_accuracy([float("nan"), 0.0, 1.0]) == 1.0


def test_tau_block_counts_each_blocks_leading_run_of_hits():
    """Greedy verification accepts a block's drafts up to its first miss: a hit after a miss
    counts for tau_sim's per-position accuracy but not for acceptance."""
    T, F = True, False
    hits = torch.tensor([[[F, T, T, F], [F, T, F, T], [F, F, T, T], [F, T, T, T]]])
    valid = torch.tensor([[[F, T, T, T], [F, T, T, T], [F, T, T, T], [F, F, F, F]]])  # last: padding
    accepted, blocks, rounds = block_acceptance(hits & valid, valid)
    assert (accepted.item(), blocks.item()) == (3.0, 3.0)  # runs 2, 1, 0; the padding block not counted
    assert tau_from_runs(3.0, 3.0) == 2.0
    assert rounds.item() == pytest.approx(1 / 3 + 1 / 2 + 1 / 1)  # 1 / (1 + run) per counted block
    # The same three blocks through per-position accuracies (2/3 at each position): 2.41.
    assert tau_from_accuracy([float("nan"), 2 / 3, 2 / 3, 2 / 3]) == pytest.approx(1 + 2 / 3 + 4 / 9 + 8 / 27)


def test_tau_decode_is_tokens_per_round_of_a_decoder_walking_the_text():
    """A decoder anchors each round where the last ended. Along a text whose acceptance length
    L(p) is 16 for 320 positions then 1 for 320 (an easy stretch, then a hard one), walking it
    takes 20 + 320 rounds for 640 tokens: tau 1.88. Anchors at every position (what validation
    samples) average to tau_block 8.5; their harmonic mean, tau_decode, is the walk's figure."""
    lengths = [16] * 320 + [1] * 320
    position = rounds = 0
    while position < len(lengths):
        position += lengths[position]
        rounds += 1
    walked = len(lengths) / rounds
    runs = torch.tensor(lengths) - 1
    hits = torch.arange(16)[None, :] <= runs[:, None]  # position 0 (the anchor) unused
    valid = torch.ones_like(hits)
    accepted, blocks, rounds_sum = block_acceptance(hits[None], valid[None])
    assert tau_from_runs(accepted.item(), blocks.item()) == pytest.approx(8.5)
    assert tau_from_rounds(blocks.item(), rounds_sum.item()) == pytest.approx(walked, rel=1e-3)


def test_train_tau_block_pools_the_runs_of_every_step_and_replica():
    """train/tau_block (and tau_decode) divides the summed runs (rounds) by the summed blocks once,
    like the loss, so a step or replica with few blocks weighs what it holds."""
    from dflash.monitor.train_metrics import train_metrics
    from dflash.step.loss import LossStats
    from dflash.step.metrics import StepMetrics

    def stats(accepted: float, blocks: float, rounds: float) -> LossStats:
        one = torch.tensor(1.0)
        return LossStats(
            weighted_ce=one,
            weight=one,
            correct=torch.ones(4),
            counted=torch.ones(4),
            accepted=torch.tensor(accepted),
            blocks=torch.tensor(blocks),
            rounds=torch.tensor(rounds),
        )

    batch = one_sample_batch()
    windows = []
    # (accepted, blocks, sum of 1 / (1 + run)) per step; replica 0: two steps; replica 1: one.
    for runs in ([(6.0, 2.0, 0.5), (0.0, 1.0, 1.0)], [(1.0, 1.0, 0.5)]):
        metrics = StepMetrics(block_size=4, num_buckets=1, device=torch.device("cpu"))
        for accepted, blocks, rounds in runs:
            metrics.add(stats(accepted, blocks, rounds), torch.tensor(1.0), batch, anchors=1)
        windows.append(metrics.publish(end_step=2, lr=1e-3))
    merged = train_metrics([windows])
    assert merged["train/tau_block"] == pytest.approx(1 + 7.0 / 4.0)
    assert merged["train/tau_decode"] == pytest.approx(4.0 / 2.0)  # blocks / rounds, pooled


# -- drafter structure ------------------------------------------------------------------------


def test_drafter_parameters_are_the_exported_layout_and_share_target_embeddings():
    target = tiny_target()
    drafter = tiny_drafter(target)
    names = set(drafter.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert all(n.startswith(("layers.", "fc.", "hidden_norm.", "norm.")) for n in names)
    assert "layers.0.self_attn.k_proj.weight" in names and "layers.1.mlp.gate_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert drafter.fc.weight.shape == (64, 2 * 64)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("clipped", [False, True])
def test_apply_is_clip_grad_norm_then_adamw_on_the_weight_normalised_gradients(device, clipped):
    """DrafterStep.apply passes the loss-weight normalisation and the clip to the fused AdamW
    kernel (its `grad_scale` input) instead of rescaling the gradients: the update must be the
    textbook one — gradients / total weight, clip_grad_norm_, then AdamW."""
    from dflash.config.schema import AdamWConfig
    from dflash.step.build import build_optimizer
    from dflash.step.loss import BlockLoss
    from dflash.step.noise import NoNoise
    from dflash.step.step import BlockSettings, DrafterStep

    drafter = tiny_drafter(tiny_target()).to(device)
    reference = copy.deepcopy(drafter)
    cfg = AdamWConfig(lr=1e-3, grad_clip=0.5 if clipped else 1e6)
    optimizer = build_optimizer(cfg, drafter.parameters())
    step = DrafterStep(
        head=None,
        drafter=drafter,
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        noise=NoNoise(),
        block_settings=BlockSettings(seed=0, num_anchors=8, loss=BlockLoss(gamma=4.0)),
        grad_clip=cfg.grad_clip,
        num_buckets=1,
    )
    reference_optimizer = torch.optim.AdamW(
        reference.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=cfg.eps
    )
    generator = torch.Generator().manual_seed(0)
    total_weight = torch.tensor(37.0, device=device)
    for _ in range(2):  # the second update also reads the moments of the first
        grads = [torch.randn(p.shape, generator=generator).to(device) for p in drafter.parameters()]
        for p, g in zip(drafter.parameters(), grads):
            p.grad = g.clone()
        for p, g in zip(reference.parameters(), grads):
            p.grad = g / total_weight
        grad_norm = step.apply(total_weight)
        want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.grad_clip)
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        torch.testing.assert_close(grad_norm, want_norm, rtol=1e-5, atol=0)
    assert (want_norm > cfg.grad_clip) == clipped
    for got, want in zip(drafter.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
