"""DFlash2 decoding: both decoders draft a block's B-1 tokens with the candidate selector (each
position's top-K unary candidates scored given the token chosen before it, the anchor first),
greedy and sampled, equal to the formula walked out by hand here; verification unchanged, so fp32
greedy output equals plain greedy and sampled output is the target's own samples; the static
decoder drafts what the reference decoder drafts, round by round; with the bilinear term zeroed
the drafts are plain DFlash's; dflash-eval reports how often the selector changed the unary
choice and how those drafts fared."""

from __future__ import annotations

import pytest
import torch

from dflash.config.schema import DrafterConfig
from dflash.decoding import engine, reference
from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import (
    DecodeResult,
    DraftChooser,
    gumbel_noise,
    plain_generate,
    samples_drafts,
    speculative_generate,
)
from dflash.decoding.settings import DecodeSettings
from dflash.decoding.static_drafter import StaticCacheDrafter
from dflash.drafters.backbone import DFlashDrafter, drafter_config
from dflash.drafters.dflash2 import DFlash2Drafter, add_dflash2_fields
from dflash.drafters.pick_recorder import SELECTOR_ROUND_FIGURES, SelectorTally, selector_outcome
from dflash.eval.evaluate import Decoders
from dflash.eval.prompt_sets import PromptSet
from dflash.eval.results import EvalReport
from dflash.run.checks import is_summary_metric
from tests.test_dflash_rules import MASK_ID, tiny_target
from tests.test_dspark_decoding import block_hidden, evaluated
from tests.test_spec_decode import ContextKeyedSampler

TOP_K = 4


def tiny_dflash2(target, *, selector_std: float = 0.2, identity_convs: bool = False) -> DFlash2Drafter:
    """A DFlash2 drafter on the tiny target (block 4, top-4 selector of rank 8, kernel-2
    convolutions in groups of 16), its convolutions moved off the identity and its selector's
    codebooks large enough to override the unary argmax at about half the draft positions."""
    cfg = DrafterConfig(name="t", num_layers=2, block_size=4, mask_token_id=MASK_ID, num_anchors=8)
    config = add_dflash2_fields(
        drafter_config(cfg, target.config, target.layer_ids),
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=TOP_K,
    )
    torch.manual_seed(1)
    drafter = DFlash2Drafter(config)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "_conv." in name and not identity_convs:
                param.add_(torch.randn_like(param) * 0.05)
            elif name.startswith("candidate_selector."):
                param.normal_(0.0, selector_std)
    return drafter.eval()


def walk_by_hand(drafter, unary_PV, hidden_PH, anchor, noise_PV=None, temperature=1.0):
    """The selector written out: at draft position k, the K best unary tokens c, each scored
    unary[c] + sum_r A[prev, r] (W h_k)[r] B[c, r] with prev the token chosen at k - 1 (the
    anchor at k = 0); the best score, or with noise the argmax of score / T + noise[k][c]."""
    selector = drafter.candidate_selector
    A, B = selector.predecessor_codebook, selector.successor_codebook
    W = selector.hidden_projection.weight
    previous, tokens = anchor, []
    for k in range(unary_PV.shape[0]):
        candidates = sorted(range(unary_PV.shape[1]), key=lambda v: -float(unary_PV[k, v]))[:TOP_K]
        projected = W @ hidden_PH[k]
        best, best_value = None, None
        for c in candidates:
            score = float(unary_PV[k, c]) + sum(
                float(A[previous, r] * projected[r] * B[c, r]) for r in range(A.shape[1])
            )
            value = score if noise_PV is None else score / temperature + float(noise_PV[k, c])
            if best_value is None or value > best_value:
                best, best_value = c, value
        previous = best
        tokens.append(best)
    return tokens


class RoundRecorder:
    """Every round's (drafts, target choices) as a decoder settles it."""

    def __init__(self, monkeypatch, module):
        self.rounds: list[tuple[list[int], list[int]]] = []
        settle = module.settle_round

        def recording(draft, choices, room, stop_ids):
            self.rounds.append((list(draft), list(choices)))
            return settle(draft, choices, room, stop_ids)

        monkeypatch.setattr(module, "settle_round", recording)


def prompt_of(seed: int, length: int) -> list[int]:
    return torch.randint(0, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_the_selector_walk_is_the_formula_written_out(softcap):
    target = tiny_target()
    drafter = tiny_dflash2(target)
    if softcap is not None:  # a released drafter's unary transform: tanh soft-capping
        drafter.settings["final_logit_softcapping"] = softcap
    generator = torch.Generator().manual_seed(3)
    head_logits = torch.randn(1, 5, 512, generator=generator) * 0.1  # the tiny head's spread
    hidden = torch.randn(1, 5, 64, generator=generator)
    unary = head_logits[0] if softcap is None else torch.tanh(head_logits[0] / softcap) * softcap
    with torch.no_grad():
        expected = walk_by_hand(drafter, unary, hidden[0], 7)
        walk = drafter.candidate_selector.walk
        unary_logits = drafter.unary_logits(head_logits)
        tokens, unary_argmax = walk(unary_logits, hidden, torch.tensor([7]), DraftChooser().among)
        noise = gumbel_noise(torch.Generator().manual_seed(4), (5, 512), torch.device("cpu"))
        sampled = walk_by_hand(drafter, unary, hidden[0], 7, noise, temperature=0.7)
        drawn, _ = walk(unary_logits, hidden, torch.tensor([7]), DraftChooser(0.7, noise).among)
    assert tokens[0].tolist() == expected
    assert unary_argmax[0].tolist() == unary.argmax(-1).tolist()
    assert drawn[0].tolist() == sampled
    # The test can fail: the selector overrides the unary argmax, and the noise moves the picks.
    assert expected != unary_argmax[0].tolist()
    assert sampled != expected


def test_both_decoders_draft_the_selector_walk_from_the_block_hidden_states():
    target = tiny_target()
    drafter = tiny_dflash2(target)
    ids = torch.randint(0, 500, (1, 13), generator=torch.Generator().manual_seed(5))
    features = target(ids).features
    anchor = int(ids[0, 12])
    context, hidden = block_hidden(drafter, target, features[:, :12], anchor)
    static = StaticCacheDrafter(drafter, target, max_len=32)
    static.write(features[:, :12], torch.arange(12)[None])
    noise = gumbel_noise(torch.Generator().manual_seed(6), (drafter.block_size, 512), torch.device("cpu"))
    with torch.no_grad():
        # The draft positions are block positions 1..B-1; the anchor slot predicts nothing.
        unary = target.lm_head(hidden[1:])
        expected = walk_by_hand(drafter, unary, hidden[1:], anchor)
        expected_sampled = walk_by_hand(drafter, unary, hidden[1:], anchor, noise, temperature=1.5)
    assert len(expected) == drafter.block_size - 1
    assert context.draft(target, anchor) == expected
    assert context.extra == unary.argmax(-1).tolist() != expected
    tokens, static_unary = static.draft_block(torch.tensor([anchor]), torch.tensor([12]), kv_len=32)
    assert tokens.tolist() == expected and static_unary.tolist() == context.extra
    context.choose = DraftChooser(1.5, noise)
    assert context.draft(target, anchor) == expected_sampled
    tokens, _ = static.draft_block(
        torch.tensor([anchor]), torch.tensor([12]), noise, kv_len=32, temperature=1.5
    )
    assert tokens.tolist() == expected_sampled != expected


def test_greedy_dflash2_decoding_equals_plain_greedy_and_both_decoders_draft_alike(monkeypatch):
    target = tiny_target()
    drafter = tiny_dflash2(target)
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    ours_rounds = RoundRecorder(monkeypatch, reference)
    static_rounds = RoundRecorder(monkeypatch, engine)
    changed = 0
    for seed in range(3):
        prompt = prompt_of(seed, 6 + 5 * seed)
        plain = plain_generate(target, prompt, DecodeSettings(24)).output_ids
        ours = speculative_generate(target, drafter, prompt, DecodeSettings(24))
        static = decoder.speculative(prompt, DecodeSettings(24))
        assert ours.output_ids == plain and static.output_ids == plain
        assert all(1 <= n <= drafter.block_size for n in ours.acceptance_lengths)  # B verified, not B + 1
        assert static.acceptance_lengths == ours.acceptance_lengths
        assert static.accepted_drafts == ours.accepted_drafts
        rounds = len(ours.acceptance_lengths)
        assert set(ours.round_figures) == set(SELECTOR_ROUND_FIGURES)
        assert all(len(figure) == rounds for figure in ours.round_figures.values())
        assert static.round_figures == ours.round_figures
        changed += sum(ours.round_figures["selector_changed"])
    # Round by round, the static decoder drafted the reference decoder's tokens.
    assert static_rounds.rounds == ours_rounds.rounds and len(ours_rounds.rounds) > 10
    assert all(len(draft) == drafter.block_size - 1 for draft, _ in ours_rounds.rounds)
    assert changed > 0  # the selector really chose: the figures above were not all zeros


def test_sampled_dflash2_drafts_are_the_same_on_both_decoders(monkeypatch):
    target = tiny_target()
    drafter = tiny_dflash2(target)
    assert samples_drafts(drafter, 1.5, True)
    assert not samples_drafts(drafter, 0.0, True) and not samples_drafts(drafter, 1.5, False)
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    prompt = prompt_of(2, 9)
    ours_rounds = RoundRecorder(monkeypatch, reference)
    static_rounds = RoundRecorder(monkeypatch, engine)
    ours = speculative_generate(
        target, drafter, prompt, DecodeSettings(30, temperature=1.5, seed=4), sampled_drafts=True
    )
    static = decoder.speculative(prompt, DecodeSettings(30, temperature=1.5, seed=4), sampled_drafts=True)
    assert static.output_ids == ours.output_ids
    assert static_rounds.rounds == ours_rounds.rounds
    assert static.round_figures == ours.round_figures
    # Sampling the drafts leaves the target's stream of choices as it is (its own generator):
    # the argmax-drafted decode at the same seed drafts other tokens and writes the same output
    # wherever no draft was accepted.
    sampled_drafts = [draft for draft, _ in ours_rounds.rounds]
    ours_rounds.rounds.clear()
    argmax_drafted = speculative_generate(
        target, drafter, prompt, DecodeSettings(30, temperature=1.5, seed=4)
    )
    assert [draft for draft, _ in ours_rounds.rounds] != sampled_drafts
    assert set(ours.accepted_drafts) == set(argmax_drafted.accepted_drafts) == {0}
    assert argmax_drafted.output_ids == ours.output_ids


def test_sampled_dflash2_decoding_commits_exactly_the_targets_samples(monkeypatch):
    """With a sampler keyed by the distribution alone, lossless sampling means speculative and
    plain decoding write the same tokens, drafts sampled or not, on both decoders."""
    monkeypatch.setattr(reference, "TokenChooser", ContextKeyedSampler)
    monkeypatch.setattr(engine, "TokenChooser", ContextKeyedSampler)
    target = tiny_target()
    drafter = tiny_dflash2(target)
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    prompt = prompt_of(8, 8)
    plain = plain_generate(target, prompt, DecodeSettings(30, temperature=1.0)).output_ids
    assert len(set(plain)) > 10  # really sampled
    assert decoder.plain(prompt, DecodeSettings(30, temperature=1.0)).output_ids == plain
    for sampled in (False, True):
        ours = speculative_generate(
            target, drafter, prompt, DecodeSettings(30, temperature=1.0), sampled_drafts=sampled
        )
        static = decoder.speculative(prompt, DecodeSettings(30, temperature=1.0), sampled_drafts=sampled)
        assert ours.output_ids == plain and static.output_ids == plain


def test_with_the_bilinear_term_zeroed_the_drafts_are_plain_dflash_argmax_drafts(monkeypatch):
    target = tiny_target()
    drafter = tiny_dflash2(target, identity_convs=True)
    with torch.no_grad():
        drafter.candidate_selector.predecessor_codebook.zero_()
    # The same backbone as a plain DFlash drafter (a DFlash2 at identity convolutions is one).
    plain_dflash = DFlashDrafter(drafter.config)
    plain_dflash.load_state_dict(
        {k: v for k, v in drafter.state_dict().items() if "_conv." not in k and "selector" not in k}
    )
    plain_dflash.eval()
    rounds = {}
    for name, model in (("dflash2", drafter), ("dflash", plain_dflash)):
        ours = RoundRecorder(monkeypatch, reference)
        static = RoundRecorder(monkeypatch, engine)
        decoder = StaticDecoder(target, model, max_len=64, graphs=False, kv_bucket=16)
        for seed in range(2):
            prompt = prompt_of(seed, 7 + 4 * seed)
            result = speculative_generate(target, model, prompt, DecodeSettings(20))
            decoder.speculative(prompt, DecodeSettings(20))
            if name == "dflash2":
                assert sum(result.round_figures["selector_changed"]) == 0
        assert ours.rounds == static.rounds
        rounds[name] = ours.rounds
        monkeypatch.undo()
    assert rounds["dflash2"] == rounds["dflash"] and len(rounds["dflash"]) > 10


def test_selector_outcome_counts_changes_their_acceptance_and_the_unary_alternative():
    def outcome(choices, accepted):
        return selector_outcome(draft=[5, 6, 7, 8], unary=[5, 9, 7, 3], choices=choices, accepted=accepted)

    # Drafts [5, 6, 7, 8] against unary [5, 9, 7, 3]: positions 1 and 3 changed.
    # Accepted 2 (5, 6 kept): the change at 1 accepted; position 2 rejected, unchanged.
    assert outcome([5, 6, 1, 2, 4], 2) == (2, 1, 0)
    # Accepted 1: the change at 1 rejected where the unary token 9 was the target's choice.
    assert outcome([5, 9, 1, 2, 4], 1) == (2, 0, 1)
    # Every draft accepted: nothing rejected, so no unary alternative to count.
    assert outcome([5, 6, 7, 8, 4], 4) == (2, 2, 0)
    tally = SelectorTally(drafts=4)
    tally.add(
        DecodeResult(
            output_ids=[],
            round_figures={
                "selector_changed": [2, 2, 0],
                "selector_changed_accepted": [1, 0, 0],
                "selector_changed_unary_right": [0, 1, 0],
            },
        )
    )
    tally.add(DecodeResult(output_ids=[], accepted_drafts=[3]))  # no selector: not counted
    assert tally.fields() == {
        "selector_change_frac": round(4 / 12, 4),
        "selector_change_accepted_frac": 0.25,
        "selector_change_unary_frac": 0.25,
    }
    quiet = SelectorTally(drafts=4)
    quiet.add(
        DecodeResult(output_ids=[], round_figures={"selector_changed": [0], "selector_changed_accepted": [0]})
    )
    assert quiet.fields()["selector_change_accepted_frac"] is None
    assert SelectorTally(drafts=4).fields() == {}


def test_the_evaluation_reports_the_selectors_changes_and_their_acceptance():
    target = tiny_target()
    drafter = tiny_dflash2(target)
    prompts = PromptSet("random", [prompt_of(seed, 8) for seed in range(2)])
    decoders = Decoders.build(
        target, drafter, max_len=8 + 20, graphs=False, sampled_drafts=True, temperatures=(0.0, 1.0)
    )
    results = [evaluated(target, decoders, drafter, prompts, temperature=t) for t in (0.0, 1.0)]
    greedy = results[0]
    assert greedy.lossless_frac == 1.0
    assert len(greedy.acceptance_histogram) == drafter.block_size + 1  # up to B per round
    # The figures are the decodes' own: recount them from the reference decoder's rounds.
    decoded = [
        speculative_generate(target, drafter, prompt, DecodeSettings(20)) for prompt in prompts.prompts
    ]
    changed = sum(sum(r.round_figures["selector_changed"]) for r in decoded)
    positions = sum(len(r.round_figures["selector_changed"]) for r in decoded) * (drafter.block_size - 1)
    assert 0 < changed < positions
    assert greedy.selector_change_frac == round(changed / positions, 4)
    assert greedy.selector_change_accepted_frac == round(
        sum(sum(r.round_figures["selector_changed_accepted"]) for r in decoded) / changed, 4
    )
    assert results[1].selector_change_frac is not None
    report = EvalReport(results=results)
    metrics = report.metrics()
    assert {
        "eval/random/selector_change_frac",
        "eval/random/selector_change_accepted_frac",
        "eval/random/selector_change_unary_frac_t1",
    } <= set(metrics)
    assert all(is_summary_metric(key) for key in metrics)
    assert "candidate selector: drafts changed from the unary argmax" in report.table()
