"""variant=lilicorr (dflash/drafters/lilicorr.py, dflash/step/lilicorr_loss.py): the greedy walk and
the lattice terms against the formulas worked by hand, the variant's loss (the path a run trains
through) and its gradients against the formulas computed block by block, the head's scores against
its formula, the figures scoring the walk's picks, training end to end (the loss falls), warm start
from a DFlash or DFlash2 checkpoint, and the config's refusals."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash.decoding.settings import DecodeSettings
from dflash.drafters.lilicorr import (
    LiLiCorrDrafter,
    add_lilicorr_fields,
    candidate_features,
    greedy_walk,
)
from dflash.export.zlab import load_drafter
from dflash.run.resume import check_resume_matches
from dflash.run.runner import format_summary, variant_summary_lines
from dflash.step.lilicorr_loss import lattice_terms, node_factors
from dflash.step.lilicorr_variant import LiLiCorrVariant
from dflash.step.step import split_final_state, variant_loss
from dflash.step.variant import DFlash2Variant
from dflash.train import train
from tests.conftest import FAST, compose_config
from tests.test_cli import dflash
from tests.test_dflash2_export import SLIDING, without_tensor, write_as_released
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


# The variant's own options (a run's `variant.*`): weights and hinge width all different, so a
# term read under another's weight shows.
VARIANT = LiLiCorrVariant(**GEOMETRY, ce_weight=0.3, margin_weight=0.5, penalty_weight=0.2, margin=1.5)


def loss_inputs(seed: int = 0):
    """The tiny target (its features carry the final state, as a run's do for LiLiCorr), the
    drafter, blocks of which one has unsupervised labels, and hidden states pointing at the
    labels' head rows (the label is a candidate there) except at two positions."""
    target = tiny_target()
    drafter = tiny_lilicorr(target)
    torch.manual_seed(seed)
    ids = torch.randint(0, 500, (2, 18))
    loss_mask = torch.ones(2, 18)
    loss_mask[1, 12:14] = 0  # the block anchored at 10 has its first label only
    blocks = blocks_for(ids, loss_mask, block_size=BLOCK, num_anchors=3, gamma=4.0)
    noise = torch.randn(2, blocks.labels.shape[1], 64)
    label_rows = F.normalize(target.lm_head.weight[blocks.labels], dim=-1)
    # Every other position also points at a decoy token, a little harder: the label is a
    # candidate there but not the argmax (the true path runs through several ranks).
    decoy_rows = F.normalize(target.lm_head.weight[torch.randint(0, 500, blocks.labels.shape)], dim=-1)
    decoyed = (torch.arange(blocks.labels.shape[1]) % 2 == 1)[None, :, None]
    hidden = 3.0 * label_rows + 0.3 * noise + decoyed * 3.3 * decoy_rows
    aimed = torch.ones(2, blocks.labels.shape[1], 1, dtype=torch.bool)
    aimed[0, [2, 7]] = False  # sample 0: block 0's second slot and block 1's last slot
    hidden = torch.where(aimed, hidden, noise)
    features = target.features(ids)
    return target, drafter, blocks, hidden.requires_grad_(True), features


def variant_block_loss(variant, *, target, drafter, blocks, hidden, features, logits_chunk=0, compiled=False):
    """The variant's loss as the step computes it (dflash/step/step.py: drafter_forward_loss splits
    the target's features by the drafter's width, then `variant_loss`); `target` anything with the
    target's `lm_head` and `embed_tokens`."""
    fused, final = split_final_state(features, drafter.config.hidden_size)
    return variant_loss(
        variant,
        hidden,
        head=target,
        drafter=drafter,
        blocks=blocks,
        features_BSF=fused,
        final_BSH=final,
        logits_chunk=logits_chunk,
        compiled=compiled,
    )


def lilicorr_loss_by_hand(variant, *, target, drafter, blocks, hidden, features):
    """dflash/step/lilicorr_loss.py's formulas, block by block and slot by slot: DFlash's
    sum_k w_k CE_k, then per block (scored alone) the lattice's prefix of slots whose label is a
    candidate (none if any label of the block is unsupervised), z_0 = start and
    z_s = pair[s - 1][g_{s-1}], CE, hinge against the best other candidate, and the penalty
    sum_k p_k relu(T[gold] - T[c_k]) with T the target's full logits at position a + s.
    Returns the numerator (DFlash's CE + the lattice mean times the weight sum), the weight sum
    and the lattice's sums (CE, hinge, penalty, slots, the true path's candidate ranks)."""
    width = drafter.config.hidden_size
    fused, final = features[..., :-width], features[..., -width:]
    head = target.lm_head.weight
    dflash_ce, weight = torch.zeros(()), 0.0
    for b, q in zip(*torch.nonzero(blocks.weights, as_tuple=True)):
        w = float(blocks.weights[b, q])
        dflash_ce = dflash_ce - w * torch.log_softmax(head @ hidden[b, q], -1)[blocks.labels[b, q]]
        weight += w
    ce = hinge = penalty = torch.zeros(())
    slots, ranks = 0, set()
    for b in range(hidden.shape[0]):
        for i, anchor in enumerate(blocks.anchors[b].tolist()):
            block = slice(i * BLOCK + 1, (i + 1) * BLOCK)  # positions 1..B-1: the draft slots
            labels, valid = blocks.labels[b, block], blocks.valid[b, block]
            if not bool(valid.all()):
                continue
            h = hidden[b, block]
            # The lattice: each slot's top-K tokens, their log-probabilities under the full
            # softmax (live: the lattice terms train the backbone through them), the target's
            # embeddings of them, the context row before the anchor (none at anchor 0).
            log_p_all = torch.log_softmax(target.lm_head(h), -1)
            ids = log_p_all.topk(variant.candidate_topk, dim=-1).indices[None]
            with torch.no_grad():
                token_emb = target.embed_tokens(ids)
            start, pair = drafter.lilicorr(
                token_emb_NSKH=token_emb,
                log_probs_NSK=log_p_all.gather(-1, ids[0])[None],
                pass_hidden_NSH=h[None],
                anchor_row_NH=drafter.context(fused[b, max(anchor - 1, 0)][None]),
                anchor_valid_N=torch.tensor([anchor >= 1 and bool(blocks.anchor_valid[b, i])]),
            )
            previous = None
            for s, label in enumerate(labels.tolist()):
                candidates = ids[0, s].tolist()
                if label not in candidates:
                    break  # the prefix the lattice can produce ends here
                gold = candidates.index(label)
                z = start[0] if s == 0 else pair[0, s - 1, previous]
                log_p = torch.log_softmax(z, -1)
                ce = ce - log_p[gold]
                best_other = torch.cat([z[:gold], z[gold + 1 :]]).max()
                hinge = hinge + torch.relu(variant.margin - (z[gold] - best_other))
                with torch.no_grad():
                    logits = head @ final[b, anchor + s]
                    rejection = (logits[label] - logits[ids[0, s]]).clamp_min(0.0)
                penalty = penalty + (log_p.exp() * rejection).sum()
                slots, previous = slots + 1, gold
                ranks.add(gold)
    lattice = (
        variant.ce_weight * ce + variant.margin_weight * hinge + variant.penalty_weight * penalty
    ) / max(slots, 1)
    return dflash_ce + lattice * weight, weight, (ce, hinge, penalty, slots, ranks)


def test_the_variants_loss_is_dflash_ce_plus_the_weighted_lattice_mean_worked_by_hand():
    """LiLiCorrVariant.block_loss (the path a run trains through) against the docstring's
    formulas computed block by block here: the numerator, its terms, the supervised slots, and
    the gradients of the hidden states, the head and the backbone's fc (the anchor row)."""
    target, drafter, blocks, hidden, features = loss_inputs()
    stats = variant_block_loss(
        VARIANT, target=target, drafter=drafter, blocks=blocks, hidden=hidden, features=features
    )
    expected, weight, (ce, hinge, penalty, slots, ranks) = lilicorr_loss_by_hand(
        VARIANT, target=target, drafter=drafter, blocks=blocks, hidden=hidden, features=features
    )
    # The tiny case covers every branch: supervised slots, slots past the lattice's prefix, a
    # block cut for an unsupervised label, a true path off the argmax, a hinge and a penalty.
    whole_blocks = blocks.valid.view(-1, BLOCK)[:, 1:].all(dim=-1)
    assert 0 < slots < int(whole_blocks.sum()) * (BLOCK - 1) and not whole_blocks.all()
    assert hinge > 0 and penalty > 0 and len(ranks) > 1
    assert float(stats.weight) == pytest.approx(weight)
    assert int(stats.lattice_slots) == slots
    torch.testing.assert_close(stats.lattice_ce, ce.detach())
    torch.testing.assert_close(stats.lattice_margin, hinge.detach())
    torch.testing.assert_close(stats.lattice_penalty, penalty.detach())
    torch.testing.assert_close(stats.weighted_ce, expected, rtol=1e-5, atol=1e-5)
    trained = [hidden, drafter.fc.weight, *drafter.lilicorr.parameters()]
    got = torch.autograd.grad(stats.weighted_ce, trained, allow_unused=True)
    want = torch.autograd.grad(expected, trained, allow_unused=True)
    assert want[1].abs().sum() > 0  # the anchor row trains the backbone's fc
    for name, g, w in zip(["hidden", "fc.weight", *dict(drafter.lilicorr.named_parameters())], got, want):
        if w is None:
            assert g is None or not g.any(), name
        else:
            # fp32 sums in another order: held to the gradient's own scale.
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()), msg=name)


def test_the_figures_score_the_walks_picks_not_the_backbones_argmax():
    target, drafter, blocks, hidden, features = loss_inputs()
    stats = variant_block_loss(
        VARIANT, target=target, drafter=drafter, blocks=blocks, hidden=hidden, features=features
    )
    fused = features[..., : -drafter.config.hidden_size]
    slots = BLOCK - 1
    hidden_slots = hidden.detach().view(2, -1, BLOCK, 64)[:, :, 1:].flatten(0, 1)
    rows, has_row = drafter.anchor_rows(fused, blocks.anchors)
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


@pytest.mark.parametrize("variant, pick", [(LiLiCorrVariant, "top1"), (DFlash2Variant, "unary")])
def test_the_pick_and_oracle_taus_are_one_rule_for_lilicorr_and_dflash2(variant, pick):
    """Both heads that pick among candidates report their plain pick's and the oracle's taus by
    the same rule (dflash/step/candidate_taus.py): 1 + the mean leading run, and blocks over
    rounds; undefined, for the same reason, where no block was measured."""
    names = [f"{pick}_tau_block", f"{pick}_tau_decode", "oracle_tau_block", "oracle_tau_decode"]
    sums_of = [f"{pick}_accepted", f"{pick}_rounds", "oracle_accepted", "oracle_rounds"]
    assert set(names) <= set(variant.figure_names)
    assert set(sums_of) <= {field.name for field in variant.metric_fields}
    sums = {
        field.name: [0.0] * BLOCK if field.width == "position" else 0.0 for field in variant.metric_fields
    }
    sums.update(weight=1.0, counted=[0.0, 1.0, 1.0, 1.0], blocks=4.0)
    sums.update(
        {f"{pick}_accepted": 2.0, f"{pick}_rounds": 3.2, "oracle_accepted": 6.0, "oracle_rounds": 2.0}
    )
    figures = variant.figures(sums)
    assert [figures[name] for name in names] == pytest.approx([1.5, 1.25, 2.5, 2.0])
    unmeasured = variant.figures({**sums, **dict.fromkeys(("blocks", *sums_of), 0.0)})
    assert all(math.isnan(unmeasured[name]) for name in names)
    assert {variant.undefined_because[name] for name in names} == {"no block measured"}


def test_dpace_with_lilicorr_is_refused_before_it_trains(make_cfg):
    """ModelOpt's lilicorr.yaml trains with the static decay only: loss=dpace is refused."""
    with pytest.raises(ValueError, match="loss=dpace .* with variant=lilicorr use loss=default"):
        train(make_cfg(LILICORR + ["loss=dpace"]))


def test_the_summary_line_is_lilicorrs_only_and_says_why_a_figure_is_missing():
    """Only a summary holding LiLiCorr's figures gets its line; an undefined argmax tau reads as
    LiLiCorr states it, never `nan`."""
    summary = {"train/tau_decode": 1.5, "train/top1_tau_decode": float("nan"), "train/ce": 2.0}
    lines = variant_summary_lines(summary)
    assert len(lines) == 1 and "walk 1.500, backbone argmax n/a (no block measured)" in lines[0]
    assert "held out" not in lines[0] and "nan" not in lines[0]
    assert variant_summary_lines({"train/tau_decode": 1.5}) == []


def test_a_dflash_checkpoint_warm_starts_the_backbone_and_the_head_starts_fresh(make_cfg, tmp_path):
    """drafter.init_from a DFlash checkpoint through a run's own preflight and loader: every
    backbone weight loads, the lattice head keeps its fresh init; a checkpoint missing a backbone
    weight is still refused, in one line naming it."""
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
    broken = without_tensor(Path(plain["checkpoint"]), tmp_path / "broken", "fc.weight")
    broken_cfg = make_cfg(LILICORR + [f"drafter.init_from={broken}"], tmp_path / "refused")
    with pytest.raises(
        ValueError, match=r"drafter.init_from=.*missing: \['fc\.weight'\]; unexpected: none"
    ) as refused:
        build_models(check_before_loading(broken_cfg))
    assert "\n" not in str(refused.value)


DFLASH2_RUN = ["variant=dflash2", "variant.selector_rank=16", "variant.selector_top_k=7"]
CONV = ["variant.conv_kernel_size=2", "variant.conv_group_size=16"]  # DFlash2's defaults at hidden 64


@pytest.fixture(scope="module")
def dflash2_checkpoint(tmp_path_factory, data_cache) -> Path:
    """A DFlash2 drafter trained two steps (convolutions of kernel 2, group 16: `CONV`), the
    source of the warm starts below."""
    cfg = compose_config(
        FAST + DFLASH2_RUN + ["train.total_steps=2"], tmp_path_factory.mktemp("d2"), data_cache
    )
    return Path(train(cfg)["checkpoint"])


def test_a_dflash2_checkpoint_warm_starts_the_backbone_and_convolutions_without_its_selector(
    make_cfg, tmp_path, dflash2_checkpoint
):
    """drafter.init_from a DFlash2 checkpoint into LiLiCorr with the same convolutions: the
    backbone and every convolution load, DFlash2's selector is left out (the lattice head replaces
    it) and the head starts fresh; without the convolutions the checkpoint is refused before any
    weights load, naming them, and so is one that lost a convolution tensor (both drafters have
    them: none starts fresh)."""
    from dflash.run.launch import build_models
    from dflash.run.preflight import check_before_loading

    source = load_drafter(dflash2_checkpoint).state_dict()
    warm_cfg = make_cfg(LILICORR + CONV + [f"drafter.init_from={dflash2_checkpoint}"], tmp_path / "warm")
    warm = build_models(check_before_loading(warm_cfg)).drafters[0]
    assert isinstance(warm, LiLiCorrDrafter)
    state = warm.state_dict()
    shared = {name for name in source if not name.startswith("candidate_selector.")}
    assert any("_conv." in name for name in shared)
    assert all(torch.equal(state[name], source[name]) for name in shared)
    assert {name for name in state if name not in source} == {
        name for name in state if name.startswith("lilicorr.")
    }
    plain_cfg = make_cfg(LILICORR + [f"drafter.init_from={dflash2_checkpoint}"], tmp_path / "plain")
    with pytest.raises(ValueError, match=r"variant.conv_kernel_size: checkpoint 2, this run None"):
        check_before_loading(plain_cfg)
    lost = "layers.0.mlp_conv.base_kernel"
    broken = without_tensor(dflash2_checkpoint, tmp_path / "broken", lost)
    broken_cfg = make_cfg(LILICORR + CONV + [f"drafter.init_from={broken}"], tmp_path / "refused")
    with pytest.raises(ValueError, match=rf"missing: \['{lost}'\]; unexpected: none") as refused:
        build_models(check_before_loading(broken_cfg))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("kernel", "group", "refusal"),
    [
        (3, 16, "variant.conv_kernel_size: checkpoint 2, this run 3"),
        (2, 32, "variant.conv_group_size: checkpoint 16, this run 32"),
    ],
)
def test_a_dflash2_checkpoint_with_other_convolutions_is_refused_before_weights_load(
    make_cfg, tmp_path, dflash2_checkpoint, kernel, group, refusal
):
    """The convolutions both variants have load from the source, so their shapes must agree: the
    preflight refuses another kernel or group in one line naming the run's key and the checkpoint
    (the loader would stop later, at a tensor's shape, naming no key)."""
    from dflash.run.preflight import check_before_loading

    conv = [f"variant.conv_kernel_size={kernel}", f"variant.conv_group_size={group}"]
    cfg = make_cfg(LILICORR + conv + [f"drafter.init_from={dflash2_checkpoint}"], tmp_path / "run")
    with pytest.raises(ValueError) as refused:
        check_before_loading(cfg)
    message = str(refused.value)
    assert message.startswith(f"drafter.init_from={dflash2_checkpoint} was trained for another drafter")
    assert f"({refusal})" in message and "\n" not in message


def test_a_released_dflash2_checkpoint_that_scales_its_logits_does_not_start_lilicorr(tmp_path):
    """A released DFlash2 drafter's backbone was trained under its logit transforms, which
    LiLiCorr trains without (a 5x logit difference): the warm start is refused naming them, as a
    DFlash2 run refuses it; the same checkpoint without them starts LiLiCorr+conv."""
    target = tiny_target()
    backbone = tiny_drafter_config(target, BLOCK, layer_types=SLIDING, sliding_window=8)
    run_config = add_lilicorr_fields(backbone, conv_kernel_size=2, conv_group_size=16, **GEOMETRY)
    write_as_released(tmp_path / "plain", unary=False)
    check_resume_matches(tmp_path / "plain", run_config, {}, key="drafter.init_from")
    write_as_released(tmp_path / "scaled")
    with pytest.raises(
        ValueError, match=r"dflash_config.output_multiplier .*: checkpoint 0.196.*this run None"
    ):
        check_resume_matches(tmp_path / "scaled", run_config, {}, key="drafter.init_from")


def test_dflash_train_refuses_other_convolutions_in_one_line_and_exit_2(tmp_path, dflash2_checkpoint):
    """The same refusal as a user meets it: `dflash train` ends in one line naming the key and
    the checkpoint, exit 2, before anything trained."""
    run_dir = tmp_path / "run"
    result = dflash(
        "train",
        *LILICORR,
        "variant.conv_kernel_size=3",
        "variant.conv_group_size=16",
        f"drafter.init_from={dflash2_checkpoint}",
        "debug=fast",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dflash train: error: "), result.stderr
    assert f"drafter.init_from={dflash2_checkpoint}" in lines[0]
    assert "variant.conv_kernel_size: checkpoint 2, this run 3" in lines[0]
    assert not (run_dir / "checkpoints").exists()


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
