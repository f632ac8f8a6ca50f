"""Rejection-sampling verification (dflash/decoding/verify.py, `eval.verify=rejection`): a
sampled draft survives with 1 - TV(p, q) and the round's token has the target's distribution
(the formulas, counted over seeded trials); the decoders' use of it."""

from __future__ import annotations

import pytest
import torch

from dflash.config.schema import VerifyRule
from dflash.decoding.reference import DraftChooser, gumbel_noise, speculative_generate
from dflash.decoding.settings import DecodeSettings
from dflash.decoding.verify import rejection_round
from dflash.eval.evaluate import Decoders
from tests.test_dflash_rules import tiny_target
from tests.test_dspark_decoding import loud_markov
from tests.test_dspark_export import tiny_dspark

# A draft distribution far from the target's: 1 - TV = 0.40, while the `match` rule keeps a
# draft drawn from p with sum p q = 0.123.
P = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
Q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.2, 0.1])
TRIALS = 20_000
TOLERANCE = 0.015  # over 4 standard deviations of a frequency at 20,000 trials


def one_position_trials(draft_probs: torch.Tensor | None, draw) -> tuple[float, torch.Tensor]:
    """Kept fraction and the frequencies of the round's first token over seeded trials; the
    target's logits at temperature 2 (the rule must divide them by it to get Q)."""
    generator = torch.Generator().manual_seed(0)
    logits = 2 * torch.log(torch.stack([Q, Q]))
    kept, counts = 0, torch.zeros(len(Q))
    for _ in range(TRIALS):
        draft = draw(generator)
        accepted, token = rejection_round(
            [draft],
            draft_probs_PV=None if draft_probs is None else draft_probs[None],
            target_logits_NV=logits,
            temperature=2.0,
            generator=generator,
        )
        kept += accepted
        counts[draft if accepted else token] += 1
    return kept / TRIALS, counts / TRIALS


def test_a_sampled_draft_survives_with_one_minus_tv_and_the_token_has_the_targets_distribution():
    kept, frequencies = one_position_trials(P, lambda g: int(torch.multinomial(P, 1, generator=g)))
    assert abs(kept - (1 - 0.5 * (P - Q).abs().sum().item())) < TOLERANCE
    assert (frequencies - Q).abs().max().item() < TOLERANCE


def test_an_argmax_draft_survives_with_the_targets_probability_of_it():
    kept, frequencies = one_position_trials(None, lambda g: 3)
    assert abs(kept - Q[3].item()) < TOLERANCE
    assert (frequencies - Q).abs().max().item() < TOLERANCE


def test_a_block_is_kept_to_the_first_draft_the_target_cannot_produce():
    """p == q keeps every draft (q/p = 1) and the bonus comes from the last position; a draft
    the target gives probability 0 is always rejected, and the residual never returns it."""
    q = torch.softmax(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), dim=-1)
    generator = torch.Generator().manual_seed(2)
    for _ in range(50):
        accepted, _ = rejection_round(
            [1, 5, 2], draft_probs_PV=q[:3], target_logits_NV=q.log(), temperature=1.0, generator=generator
        )
        assert accepted == 3
        logits = q.log().clone()
        logits[1, 5] = float("-inf")
        accepted, token = rejection_round(
            [1, 5, 2], draft_probs_PV=None, target_logits_NV=logits, temperature=1.0, generator=generator
        )
        assert accepted <= 1 and (accepted == 0 or token != 5)
    with pytest.raises(ValueError, match="temperature > 0"):
        rejection_round([1], draft_probs_PV=None, target_logits_NV=q[:2], temperature=0.0, generator=None)


def test_the_draft_chooser_records_what_each_draft_was_drawn_from():
    """DSpark's positions: softmax(logits / T) over the vocabulary; a DFlash2 selector's: the
    softmax of its scores over the candidates, zero elsewhere; each draft in its support."""
    generator = torch.Generator().manual_seed(3)
    noise = gumbel_noise(generator, (2, 10), torch.device("cpu"))
    choose = DraftChooser(1.5, noise, record=True)
    logits = torch.randn(1, 10, generator=generator)
    token = choose(logits)
    candidates = torch.tensor([[7, 2, 4]])
    index = choose.among(torch.randn(1, 3, generator=generator), candidates, 1)
    first, second = choose.drafted_distributions()
    torch.testing.assert_close(first, torch.softmax(logits[0] / 1.5, dim=-1))
    assert first[token] > 0 and second[candidates[0, index]] > 0
    assert second.nonzero().flatten().tolist() == [2, 4, 7]
    torch.testing.assert_close(second.sum(), torch.tensor(1.0))


def test_decoding_with_rejection_sampling_settles_each_round_by_the_rule(monkeypatch):
    """Greedy output is the same under both rules. At a temperature > 0 each round goes to
    `rejection_round` with the distributions DSpark drew its drafts from (its Markov-biased
    softmax at the temperature, one row per draft, each draft in its row's support) and the
    target's logits of the round; the round keeps what the rule kept and appends its token."""
    from dflash.decoding import reference

    target = tiny_target()
    drafter = loud_markov(tiny_dspark(target, head_type="gated"))
    prompt = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    greedy = speculative_generate(target, drafter, prompt, DecodeSettings(30))
    assert (
        speculative_generate(target, drafter, prompt, DecodeSettings(30), verify=VerifyRule.rejection)
        == greedy
    )

    rounds = []

    def settled_as_an_oracle_says(draft, *, draft_probs_PV, target_logits_NV, temperature, generator):
        kept = (len(rounds) + 1) % 3  # whatever the rule says is what the round keeps
        token = (draft[kept] + 1) % 512 if kept < len(draft) else 7
        rounds.append((draft, draft_probs_PV, target_logits_NV.shape, kept, token))
        return kept, token

    monkeypatch.setattr(reference, "rejection_round", settled_as_an_oracle_says)
    sampled = speculative_generate(
        target,
        drafter,
        prompt,
        DecodeSettings(30, temperature=1.0, seed=4),
        sampled_drafts=True,
        verify=VerifyRule.rejection,
    )
    blocks = drafter.block_size
    assert rounds and len(rounds) == len(sampled.accepted_drafts)
    produced = sampled.output_ids[:1]  # the first token is the prefill's
    for draft, probs, logits_shape, kept, token in rounds:
        assert probs.shape == (blocks, target.config.vocab_size) and logits_shape[0] == blocks + 1
        torch.testing.assert_close(probs.sum(-1), torch.ones(blocks))
        assert all(probs[k, drafted] > 0 for k, drafted in enumerate(draft))
        produced += draft[:kept] + [token]
    assert [kept for *_, kept, _ in rounds] == sampled.accepted_drafts
    assert sampled.output_ids == produced[:30]


def test_rejection_verification_decodes_on_the_reference_decoder():
    target = tiny_target()
    drafter = tiny_dspark(target, head_type="vanilla")
    kwargs = dict(max_len=40, graphs=False, sampled_drafts=True, temperatures=(1.0,))
    assert Decoders.build(target, drafter, **kwargs).prefill is not None  # the static decoder
    assert Decoders.build(target, drafter, verify=VerifyRule.rejection, **kwargs).prefill is None
