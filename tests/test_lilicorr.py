"""variant=lilicorr (dflash/drafters/lilicorr.py, dflash/step/lilicorr_loss.py): the greedy walk and
the lattice terms against the formulas worked by hand, the head's scores against its formula, the
figures scoring the walk's picks, training end to end (the loss falls), warm start from a DFlash
checkpoint, and the config's refusals."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from dflash.decoding.settings import DecodeSettings
from dflash.drafters.lilicorr import (
    LiLiCorrDrafter,
    add_lilicorr_fields,
    candidate_features,
    greedy_walk,
)
from dflash.export.zlab import load_drafter
from dflash.run.runner import figure, format_summary, is_defined
from dflash.step.lilicorr_loss import LatticeWeights, lattice_terms, lilicorr_loss, node_factors
from dflash.step.lilicorr_variant import LiLiCorrVariant
from dflash.train import train
from tests.test_dflash_rules import blocks_for, tiny_drafter_config
from tests.test_dspark import tiny_target

BLOCK = 4
GEOMETRY = dict(
    candidate_topk=4,
    hidden_size=None,
    num_layers=1,
    num_heads=2,
    mlp_ratio=2.0,
    factor_dim=8,
    vector_eps=1e-4,
    logit_scale=8.0,
)


def lilicorr_config(target, **geometry):
    return add_lilicorr_fields(copy.deepcopy(tiny_drafter_config(target, BLOCK)), **{**GEOMETRY, **geometry})


def tiny_lilicorr(target, *, seed: int = 1, scale: float = 0.3) -> LiLiCorrDrafter:
    """A LiLiCorr drafter on the tiny target whose head is far from its init (its picks differ
    from the backbone's argmax, and every weight must really load)."""
    torch.manual_seed(seed)
    drafter = LiLiCorrDrafter(lilicorr_config(target))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.startswith("lilicorr."):
                param.add_(torch.randn_like(param) * scale)
    return drafter


# -- the walk and the loss, by hand -------------------------------------------------------------


def test_the_walk_takes_each_slots_best_successor_of_its_own_pick_not_the_best_path():
    """start [0, 1] picks c_0 = 1; from 1 the pair row [0, 5] picks 1; from 1 the row [2, 0]
    picks 0. The best whole path (0 -> 0 -> 1: 0 + 9 + 7) is not what a greedy walk takes."""
    start = torch.tensor([[0.0, 1.0]])
    pair = torch.tensor([[[[9.0, 0.0], [0.0, 5.0]], [[0.0, 7.0], [2.0, 0.0]]]])
    assert greedy_walk(start, pair).tolist() == [[1, 1, 0]]


def test_the_lattice_terms_equal_their_formulas_worked_by_hand():
    """One block, 2 slots, K = 2; the true path is candidate 1 then candidate 0.
    z_0 = start = [0, ln 3]: CE_0 = -ln(3/4); gap 0 - ... : z_gold - z_other = ln 3.
    z_1 = pair[0][1, :] = [ln 4, 0]: CE_1 = -ln(4/5); gap ln 4.
    hinge width 2: relu(2 - ln 3) + relu(2 - ln 4).
    rejection [[1.5, 0], [0, 2]]: PEN_0 = (1/4) 1.5, PEN_1 = (1/5) 2."""
    start = torch.tensor([[0.0, math.log(3)]])
    pair = torch.tensor([[[[0.0, 0.0], [math.log(4), 0.0]]]])
    gold = torch.tensor([[1, 0]])
    nodes = node_factors(start, pair, gold)
    torch.testing.assert_close(nodes, torch.tensor([[[0.0, math.log(3)], [math.log(4), 0.0]]]))
    rejection = torch.tensor([[[1.5, 0.0], [0.0, 2.0]]])
    ce, hinge, penalty = lattice_terms(nodes, gold, torch.ones(1, 2, dtype=torch.bool), rejection, 2.0)
    assert ce.item() == pytest.approx(-math.log(3 / 4) - math.log(4 / 5), rel=1e-6)
    assert hinge.item() == pytest.approx((2 - math.log(3)) + (2 - math.log(4)), rel=1e-6)
    assert penalty.item() == pytest.approx(1.5 / 4 + 2 / 5, rel=1e-6)
    # An unsupervised slot (outside the lattice's prefix) adds nothing.
    ce, hinge, penalty = lattice_terms(nodes, gold, torch.tensor([[True, False]]), rejection, 2.0)
    assert ce.item() == pytest.approx(-math.log(3 / 4), rel=1e-6)
    assert penalty.item() == pytest.approx(1.5 / 4, rel=1e-6)


def test_candidate_features_are_the_five_of_the_reference():
    log_probs = torch.log(torch.tensor([[[0.5, 0.25, 0.125]]]))
    features = candidate_features(log_probs)[0, 0]
    torch.testing.assert_close(features[:, 0], log_probs[0, 0])
    torch.testing.assert_close(features[:, 1], torch.tensor([0.5, 0.25, 0.125]))
    torch.testing.assert_close(features[:, 2], log_probs[0, 0] - math.log(0.5))
    torch.testing.assert_close(features[:, 3], torch.tensor([0.0, 0.5, 1.0]))
    torch.testing.assert_close(features[:, 4], torch.tensor([1.0, 0.0, 0.0]))


def test_the_head_scores_are_scaled_cosines_of_its_vectors():
    """start and pair in [-scale, scale]; a head whose out/in vectors are identical makes every
    pair factor between a candidate and itself the scale."""
    target = tiny_target()
    drafter = tiny_lilicorr(target)
    torch.manual_seed(0)
    logits = torch.randn(3, BLOCK - 1, 512)
    ids, start, pair = drafter.score(
        logits_NSV=logits,
        hidden_NSH=torch.randn(3, BLOCK - 1, 64),
        embed_tokens=target.embed_tokens,
        anchor_row_NH=torch.randn(3, 64),
        anchor_valid_N=torch.tensor([True, True, False]),
    )
    assert ids.shape == (3, BLOCK - 1, 4) and torch.equal(ids[..., 0], logits.argmax(-1))
    assert start.shape == (3, 4) and pair.shape == (3, BLOCK - 2, 4, 4)
    assert start.abs().max() <= 8.0 + 1e-4 and pair.abs().max() <= 8.0 + 1e-4


def loss_inputs(seed: int = 0):
    target = tiny_target()
    drafter = tiny_lilicorr(target)
    torch.manual_seed(seed)
    ids = torch.randint(0, 500, (2, 18))
    blocks = blocks_for(ids, torch.ones(2, 18), block_size=BLOCK, num_anchors=3, gamma=4.0)
    hidden = torch.randn(2, blocks.labels.shape[1], 64)
    # Most positions point at their label's head row: the label is a candidate there.
    rows = target.lm_head.weight[blocks.labels]
    hidden = 3.0 * rows / rows.norm(dim=-1, keepdim=True) + 0.3 * hidden
    features = target.features(ids)
    return target, drafter, blocks, hidden.requires_grad_(True), features


def test_the_loss_is_dflash_ce_plus_the_weighted_lattice_terms_and_scores_the_walk():
    target, drafter, blocks, hidden, features = loss_inputs()
    features_BSF, final_BSH = features[..., :-64], features[..., -64:]
    weights = LatticeWeights(ce=0.25, margin=0.5, penalty=0.25, margin_width=2.0)

    def run(w):
        return lilicorr_loss(
            hidden,
            lm_head=target.lm_head,
            embed_tokens=target.embed_tokens,
            drafter=drafter,
            blocks=blocks,
            features_BSF=features_BSF,
            final_BSH=final_BSH,
            weights=w,
        )

    stats = run(weights)
    plain = run(LatticeWeights(ce=0.0, margin=0.0, penalty=0.0, margin_width=2.0))
    assert stats.lattice_slots > 0 and stats.lattice_penalty > 0
    lattice = (
        0.25 * stats.lattice_ce + 0.5 * stats.lattice_margin + 0.25 * stats.lattice_penalty
    ) / stats.lattice_slots
    torch.testing.assert_close(stats.loss(), plain.loss() + lattice)
    # The penalty weights by hand: the target's logits at a + s for slot s's candidates.
    stats.loss().backward()
    assert all(p.grad is not None for p in drafter.lilicorr.parameters() if p.requires_grad)
    assert drafter.fc.weight.grad.abs().sum() > 0  # the anchor row trains the backbone's fc
    # The figures score the walk's picks: count them by hand.
    slots = BLOCK - 1
    hidden_slots = hidden.detach().view(2, -1, BLOCK, 64)[:, :, 1:].flatten(0, 1)
    rows, has_row = drafter.anchor_rows(features_BSF, blocks.anchors)
    with torch.no_grad():
        ids, start, pair = drafter.score(
            logits_NSV=target.lm_head(hidden_slots),
            hidden_NSH=hidden_slots,
            embed_tokens=target.embed_tokens,
            anchor_row_NH=rows.flatten(0, 1),
            anchor_valid_N=(has_row & blocks.anchor_valid).flatten(),
        )
    picks = ids.gather(-1, greedy_walk(start, pair)[..., None])[..., 0]
    labels = blocks.labels.view(2, -1, BLOCK)[:, :, 1:].flatten(0, 1)
    valid = blocks.valid.view(2, -1, BLOCK)[:, :, 1:].flatten(0, 1)
    hits = (picks == labels) & valid
    assert stats.correct[1:].tolist() == hits.sum(dim=0).float().tolist()
    runs = sum(int(hits[n].int().cumprod(0).sum()) for n in range(hits.shape[0]) if valid[n, 0])
    assert stats.accepted.item() == runs and len(stats.correct) == slots + 1
    top1 = (ids[..., 0] == labels) & valid
    assert not torch.equal(top1, hits)  # the head's picks are not the backbone's argmax here


def test_the_penalty_weights_are_the_targets_logit_gaps_at_the_slots_own_positions():
    """relu(T[gold] - T[c]) with T the target's full logits at position a + s (the ones that
    predict slot s's token a + s + 1), worked block by block from the LM head on the final state."""
    from dflash.step.lilicorr_loss import _rejection_weights

    target, _, blocks, _, features = loss_inputs()
    final = features[..., -64:]
    slots = BLOCK - 1
    n = blocks.anchors.numel()
    ids = torch.randint(0, 512, (n, slots, 4), generator=torch.Generator().manual_seed(2))
    gold = torch.randint(0, 4, (n, slots), generator=torch.Generator().manual_seed(3))
    weights = _rejection_weights(
        final_BSH=final, lm_head=target.lm_head, blocks=blocks, ids_NSK=ids, gold_NS=gold
    )
    per_sample = blocks.anchors.shape[1]
    for block in range(n):
        b, anchor = block // per_sample, int(blocks.anchors.flatten()[block])
        for slot in range(slots):
            position = min(anchor + slot, final.shape[1] - 1)
            logits = target.lm_head(final[b, position])
            gold_logit = logits[ids[block, slot, gold[block, slot]]]
            expected = (gold_logit - logits[ids[block, slot]]).clamp_min(0.0)
            torch.testing.assert_close(weights[block, slot], expected, rtol=1e-5, atol=1e-5)


def test_a_block_without_its_anchors_row_zeroes_the_anchor_and_trains():
    target = tiny_target()
    drafter = tiny_lilicorr(target)
    features = torch.randn(1, 10, 128)
    rows, valid = drafter.anchor_rows(features, torch.tensor([[0, 5]]))
    assert valid.tolist() == [[False, True]]
    torch.testing.assert_close(rows[0, 1], drafter.context(features[:, 4])[0])


# -- training, warm start, refusals -------------------------------------------------------------

LILICORR = ["variant=lilicorr", "variant.candidate_topk=4", "variant.num_heads=2", "variant.num_layers=1"]


def test_variant_lilicorr_trains_end_to_end_and_its_loss_falls(make_cfg):
    cfg = make_cfg(LILICORR + ["train.total_steps=12", "logger.every_steps=4", "data.val_samples=16"])
    summary = train(cfg)
    assert summary["steps"] == 12 and summary["eval/lossless_frac"] == 1.0
    rows = [
        json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    for name in ("ce", "lattice_ce", "lattice_penalty", "top1_tau_decode", "oracle_tau_decode"):
        assert math.isfinite(summary[f"train/{name}"]) and math.isfinite(summary[f"val/{name}"]), name
    assert len(losses) >= 2 and losses[-1] < losses[0]
    checkpoint = load_drafter(summary["checkpoint"])
    assert isinstance(checkpoint, LiLiCorrDrafter)
    assert checkpoint.config.dflash_config["lilicorr_candidate_topk"] == 4
    # The run summary's own line sets the walk's tau (the served path) beside the argmax's.
    (line,) = [line for line in format_summary(summary).splitlines() if line.startswith("lilicorr ")]
    walk, top1 = f"{summary['train/tau_decode']:.3f}", f"{summary['train/top1_tau_decode']:.3f}"
    assert f"tau_decode walk {walk}, backbone argmax {top1}" in line
    assert f"({summary['val/tau_decode']:.3f}, {summary['val/top1_tau_decode']:.3f}," in line


def test_dpace_with_lilicorr_is_refused_before_it_trains(make_cfg):
    """ModelOpt's lilicorr.yaml trains with the static decay only: loss=dpace is refused."""
    with pytest.raises(ValueError, match="loss=dpace .* with variant=lilicorr use loss=default"):
        train(make_cfg(LILICORR + ["loss=dpace"]))


def test_the_summary_line_is_lilicorrs_only_and_says_why_a_figure_is_missing():
    """Only a summary holding LiLiCorr's figures gets its line; an undefined argmax tau reads as
    LiLiCorr states it, never `nan`."""
    summary = {"train/tau_decode": 1.5, "train/top1_tau_decode": float("nan"), "train/ce": 2.0}
    lines = LiLiCorrVariant.summary_lines(summary, figure, is_defined)
    assert len(lines) == 1 and "walk 1.500, backbone argmax n/a (no block measured)" in lines[0]
    assert "held out" not in lines[0] and "nan" not in lines[0]
    assert LiLiCorrVariant.summary_lines({"train/tau_decode": 1.5}, figure, is_defined) == []


def test_a_dflash_checkpoint_warm_starts_the_backbone_and_the_head_starts_fresh(make_cfg, tmp_path):
    """drafter.init_from a DFlash checkpoint through a run's own preflight and loader: every
    backbone weight loads, the lattice head keeps its fresh init; a missing backbone weight is
    still refused."""
    from dflash.run.launch import build_models
    from dflash.run.preflight import check_before_loading

    plain = train(make_cfg(["train.total_steps=2"], output_dir=tmp_path / "dflash"))
    warm_cfg = make_cfg(LILICORR + [f"drafter.init_from={plain['checkpoint']}"], tmp_path / "warm")
    warm = build_models(check_before_loading(warm_cfg)).drafters[0]
    assert isinstance(warm, LiLiCorrDrafter)
    source = load_drafter(plain["checkpoint"]).state_dict()
    state = warm.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in source.items())
    added = {name for name in state if name not in source}
    assert added == {name for name in state if name.startswith("lilicorr.")} and added


DFLASH2_RUN = ["variant=dflash2", "variant.selector_rank=16", "variant.selector_top_k=7"]
CONV = ["variant.conv_kernel_size=2", "variant.conv_group_size=16"]  # DFlash2's defaults at hidden 64


def test_a_dflash2_checkpoint_warm_starts_the_backbone_and_convolutions_without_its_selector(
    make_cfg, tmp_path
):
    """drafter.init_from a DFlash2 checkpoint into LiLiCorr with the same convolutions: the
    backbone and every convolution load, DFlash2's selector is left out (the lattice head replaces
    it) and the head starts fresh; without the convolutions the checkpoint is refused, naming them."""
    from dflash.run.launch import build_models
    from dflash.run.preflight import check_before_loading

    source_run = train(make_cfg(DFLASH2_RUN + ["train.total_steps=2"], output_dir=tmp_path / "dflash2"))
    source = load_drafter(source_run["checkpoint"]).state_dict()
    warm_cfg = make_cfg(
        LILICORR + CONV + [f"drafter.init_from={source_run['checkpoint']}"], tmp_path / "warm"
    )
    warm = build_models(check_before_loading(warm_cfg)).drafters[0]
    assert isinstance(warm, LiLiCorrDrafter)
    state = warm.state_dict()
    shared = {name for name in source if not name.startswith("candidate_selector.")}
    assert any("_conv." in name for name in shared)
    assert all(torch.equal(state[name], source[name]) for name in shared)
    assert {name for name in state if name not in source} == {
        name for name in state if name.startswith("lilicorr.")
    }
    plain_cfg = make_cfg(LILICORR + [f"drafter.init_from={source_run['checkpoint']}"], tmp_path / "plain")
    with pytest.raises(ValueError, match="unexpected: .*attention_conv"):
        build_models(check_before_loading(plain_cfg))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["variant.candidate_topk=6"], "variant.candidate_topk=6: must be a power of two"),
        (["variant.num_heads=3"], r"variant.num_heads=3 must divide the head's width \(64\)"),
        (
            ["variant.ce_weight=0", "variant.penalty_weight=0"],
            "never trains the lattice head",
        ),
        (["variant.vector_eps=0.7"], r"variant.vector_eps=0.7: must be in \(0, 0.5\)"),
        (["variant.conv_kernel_size=2"], "variant.conv_kernel_size and variant.conv_group_size: set both"),
        (
            CONV[:1] + ["variant.conv_group_size=7"],
            r"variant.conv_group_size=7 must divide the hidden size \(64\)",
        ),
    ],
)
def test_bad_lilicorr_settings_are_refused_naming_the_key(make_cfg, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(make_cfg(["variant=lilicorr", *overrides]))


def test_the_head_reads_the_anchor_row_it_is_given():
    """Changing the anchor row changes the start factors (the head is conditioned on it)."""
    target = tiny_target()
    drafter = tiny_lilicorr(target)
    inputs = dict(
        logits_NSV=torch.randn(1, BLOCK - 1, 512),
        hidden_NSH=torch.randn(1, BLOCK - 1, 64),
        embed_tokens=target.embed_tokens,
        anchor_valid_N=torch.tensor([True]),
    )
    _, start_a, _ = drafter.score(anchor_row_NH=torch.randn(1, 64), **inputs)
    _, start_b, _ = drafter.score(anchor_row_NH=torch.randn(1, 64), **inputs)
    assert not torch.allclose(start_a, start_b)
    # Without its row (anchor_valid False) the anchor is zeroed: which row is passed no longer matters.
    inputs["anchor_valid_N"] = torch.tensor([False])
    _, start_a, _ = drafter.score(anchor_row_NH=torch.randn(1, 64), **inputs)
    _, start_b, _ = drafter.score(anchor_row_NH=torch.randn(1, 64), **inputs)
    torch.testing.assert_close(start_a, start_b)


# -- decoding -----------------------------------------------------------------------------------


def test_both_decoders_draft_the_walk_from_the_context_row_before_each_anchor(monkeypatch):
    """Lossless in both decoders; each round's lattice is scored with the projected target row
    at anchor - 1 (checked against the full sequence's features), and the drafts are the walk's
    picks: they differ from the backbone's argmax in some rounds (the selector figures count it)."""
    from dflash.decoding.engine import StaticDecoder
    from dflash.decoding.reference import plain_generate, speculative_generate
    from tests.test_dflash_rules import tiny_target as plain_target

    target = plain_target()
    drafter = tiny_lilicorr(target).eval()
    rows: list[torch.Tensor] = []
    draft_block = LiLiCorrDrafter.draft_block

    def recording(self, lm_head, hidden, anchor, choose, *, embed_tokens, anchor_row_1H):
        rows.append(anchor_row_1H.detach().clone())
        return draft_block(
            self, lm_head, hidden, anchor, choose, embed_tokens=embed_tokens, anchor_row_1H=anchor_row_1H
        )

    monkeypatch.setattr(LiLiCorrDrafter, "draft_block", recording)
    prompt = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = plain_generate(target, prompt, DecodeSettings(16)).output_ids
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    for decode in (
        lambda: speculative_generate(target, drafter, prompt, DecodeSettings(16)),
        lambda: decoder.speculative(prompt, DecodeSettings(16)),
    ):
        rows.clear()
        result = decode()
        assert result.output_ids == plain
        assert sum(result.round_figures["selector_changed"]) > 0
        with torch.no_grad():
            context = drafter.context(target.features(torch.tensor([prompt + plain])))[0]
        anchors = [len(prompt) + sum(result.acceptance_lengths[:r]) for r in range(len(rows))]
        assert len(rows) == len(result.acceptance_lengths)
        for row, anchor in zip(rows, anchors):
            torch.testing.assert_close(row[0], context[anchor - 1], rtol=1e-4, atol=1e-5)


def test_drafts_stay_the_walks_argmax_at_a_temperature():
    """As SGLang serves it: deterministic drafts, verified as point masses; no draft noise is
    drawn even when sampled drafts are asked for."""
    from dflash.decoding.reference import samples_drafts

    drafter = tiny_lilicorr(tiny_target())
    assert not samples_drafts(drafter, 0.8, sampled_drafts=True)
