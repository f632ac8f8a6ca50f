"""DSpark decoding: both decoders draft a block left to right with the Markov bias (each slot
biased by the token actually drafted before it), greedy and sampled, equal to a step-by-step
reference written out here; verification unchanged, so fp32 greedy output equals plain greedy;
the static decoder equals the reference decoder on CPU; dflash-eval sets the confidence head's
predicted acceptance beside the measured one."""

from __future__ import annotations

import pytest
import torch

from dflash.decoding import reference
from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import (
    DecodeResult,
    DraftChooser,
    DrafterContext,
    gumbel_noise,
    plain_generate,
    speculative_generate,
)
from dflash.decoding.settings import DecodeSettings
from dflash.decoding.static_drafter import StaticCacheDrafter
from dflash.drafters.backbone import DFlashDrafter
from dflash.drafters.dspark_tally import ConfidenceTally
from dflash.eval.evaluate import Decoders, evaluate_set
from dflash.eval.journal import EvalJournal
from dflash.eval.prompt_sets import PromptSet
from dflash.eval.results import BenchmarkResult, EvalReport
from dflash.run.checks import is_summary_metric
from dflash.step.blocks import layer_masks
from dflash.target.model import FrozenTarget
from tests.test_dflash_rules import MASK_ID, tiny_target
from tests.test_dspark_export import tiny_dspark
from tests.test_spec_decode import ContextKeyedSampler
from tests.test_static_decoding import HYBRIDS, family_target

HEADS = ["vanilla", "gated", "rnn"]


def loud_markov(drafter):
    """Markov weights large enough that the bias, not the base logits, decides most drafts: a
    drafter that ignored the bias or chained the wrong previous token drafts other tokens."""
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.mul_(30)
        drafter.markov_head.markov_w2.weight.mul_(30)
    return drafter.eval()


def step_by_step(drafter, target, hidden_BH, anchor, noise_BV=None, temperature=1.0):
    """The DSpark draft written out (DeepSpec's markov_head.py, paper eqs. 5-7): slot k's logits
    are the target head's logits on h_k plus W2 applied to the head's latent from the previous
    token x_{k-1} (the anchor for k = 0); x_k is their argmax (or, with noise, a Gumbel-max
    sample); the confidence head reads [h_k; W1[x_{k-1}]]."""
    head, w1 = drafter.markov_head, drafter.markov_head.markov_w1.weight
    w2 = head.markov_w2.weight
    kind = drafter.config.markov_head_type
    state = torch.zeros(drafter.markov_rank)
    previous, tokens, survival = anchor, [], []
    for k in range(hidden_BH.shape[0]):
        h, e = hidden_BH[k], w1[previous]
        if kind == "vanilla":
            latent = e
        elif kind == "gated":
            gate = torch.sigmoid(head.gate_proj.weight @ torch.cat([h, e]) + head.gate_proj.bias)
            latent = gate * e
        else:
            z = head.joint_proj.weight @ torch.cat([state, e, h]) + head.joint_proj.bias
            g, c, o = z.split(drafter.markov_rank)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            latent = torch.tanh(o)
        logits = target.lm_head(h) + w2 @ latent
        if noise_BV is not None:
            logits = logits / temperature + noise_BV[k]
        proj = drafter.confidence_head.proj
        features = torch.cat([h, e]) if drafter.confidence_with_markov else h
        survival.append(float(torch.sigmoid(proj.weight[0] @ features + proj.bias[0])))
        previous = int(logits.argmax())
        tokens.append(previous)
    return tokens, survival


def block_hidden(drafter, target, features, anchor):
    """The backbone's hidden states of the block [anchor, MASK...] after the context `features`."""
    length = features.shape[1]
    context = DrafterContext(drafter)
    context.extend(features)
    block_ids = torch.tensor([[anchor] + [MASK_ID] * (drafter.block_size - 1)])
    positions = torch.arange(length, length + drafter.block_size)[None]
    mask = layer_masks(
        torch.tensor([[length]]),
        torch.ones(1, 1, dtype=torch.bool),
        ctx_len=length,
        block_size=drafter.block_size,
        windows=drafter.windows,
    )
    with torch.no_grad():
        return context, drafter.draft(context.kv, target.embed_tokens(block_ids), positions, mask)[0]


@pytest.mark.parametrize("head", HEADS)
def test_markov_drafting_equals_the_step_by_step_reference(head):
    target = tiny_target()
    drafter = loud_markov(tiny_dspark(target, head_type=head))
    ids = torch.randint(0, 500, (1, 13), generator=torch.Generator().manual_seed(5))
    features = target(ids).features
    anchor = int(ids[0, 12])
    context, hidden = block_hidden(drafter, target, features[:, :12], anchor)
    with torch.no_grad():
        expected, survival = step_by_step(drafter, target, hidden, anchor)
    # The reference decoder's draft: B tokens (the anchor's slot drafts too).
    assert context.draft(target, anchor) == expected and len(expected) == drafter.block_size
    torch.testing.assert_close(torch.tensor(context.extra), torch.tensor(survival))
    # The static decoder's draft, from its own cache of the same context.
    static = StaticCacheDrafter(drafter, target, max_len=32)
    static.write(features[:, :12], torch.arange(12)[None])
    tokens, static_survival = static.draft_block(torch.tensor([anchor]), torch.tensor([12]), kv_len=32)
    assert tokens.tolist() == expected
    torch.testing.assert_close(static_survival, torch.tensor(survival))
    # The test can fail: without the bias, or with every slot biased by the anchor, others come out.
    unbiased = target.lm_head(hidden).argmax(-1).tolist()
    assert unbiased != expected
    with torch.no_grad():
        anchored = [
            int(
                (
                    target.lm_head(hidden[k])
                    + drafter.markov_head.bias(drafter.markov_head.embed(torch.tensor(anchor)))
                ).argmax()
            )
            for k in range(drafter.block_size)
        ]
    assert head != "vanilla" or anchored != expected


def test_sampled_drafting_is_gumbel_max_at_the_temperature():
    target = tiny_target()
    drafter = loud_markov(tiny_dspark(target, head_type="rnn"))
    ids = torch.randint(0, 500, (1, 11), generator=torch.Generator().manual_seed(6))
    features = target(ids).features
    anchor = int(ids[0, 10])
    context, hidden = block_hidden(drafter, target, features[:, :10], anchor)
    draws = []
    for seed in range(6):
        noise = gumbel_noise(
            torch.Generator().manual_seed(seed), (drafter.block_size, 512), torch.device("cpu")
        )
        with torch.no_grad():
            expected, _ = step_by_step(drafter, target, hidden, anchor, noise, temperature=2.0)
        context.choose = DraftChooser(2.0, noise)
        draws.append(context.draft(target, anchor))
        assert draws[-1] == expected
    assert len({tuple(d) for d in draws}) > 1  # the noise is used: the drafts vary with it


@pytest.mark.parametrize("heads", [dict(head_type="vanilla"), dict(head_type="rnn", confidence=False)])
def test_greedy_dspark_decoding_equals_plain_greedy_on_both_decoders(heads):
    target = tiny_target()
    drafter = loud_markov(tiny_dspark(target, **heads))
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    for seed in range(3):
        prompt = torch.randint(
            0, 500, (6 + 5 * seed,), generator=torch.Generator().manual_seed(seed)
        ).tolist()
        plain = plain_generate(target, prompt, DecodeSettings(24)).output_ids
        ours = speculative_generate(target, drafter, prompt, DecodeSettings(24))
        static = decoder.speculative(prompt, DecodeSettings(24))
        assert ours.output_ids == plain and static.output_ids == plain
        assert sum(ours.acceptance_lengths) == 24 - 1
        assert all(1 <= n <= drafter.block_size + 1 for n in ours.acceptance_lengths)
        # The same drafts on both decoders: the same acceptance and the same confidence.
        assert static.acceptance_lengths == ours.acceptance_lengths
        assert static.accepted_drafts == ours.accepted_drafts
        if drafter.confidence_head is not None:
            assert len(ours.round_figures["confidence"]) == len(ours.acceptance_lengths)
            torch.testing.assert_close(
                torch.tensor(static.round_figures["confidence"]),
                torch.tensor(ours.round_figures["confidence"]),
            )
        else:
            assert ours.round_figures == {} and static.round_figures == {}


def test_a_perfect_dspark_drafter_is_accepted_block_plus_one(monkeypatch):
    """B drafts per round, verified as B + 1 tokens: an oracle's rounds produce B + 1 each."""
    target = tiny_target()
    drafter = tiny_dspark(target).eval()
    prompt = torch.randint(0, 500, (10,)).tolist()
    truth = plain_generate(target, prompt, DecodeSettings(41)).output_ids

    def oracle(context, target_, anchor_token):
        start = context.length + 1 - len(prompt)
        return truth[start : start + drafter.block_size]

    monkeypatch.setattr(reference, "drafter_guess", oracle)
    result = speculative_generate(target, drafter, prompt, DecodeSettings(41))
    assert result.output_ids == truth
    assert result.acceptance_lengths == [drafter.block_size + 1] * 8
    assert result.accepted_drafts == [drafter.block_size] * 8


def test_sampled_dspark_drafts_are_the_same_on_both_decoders():
    target = tiny_target()
    drafter = loud_markov(tiny_dspark(target, head_type="gated"))
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    prompt = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = speculative_generate(
        target, drafter, prompt, DecodeSettings(30, temperature=1.5, seed=4), sampled_drafts=True
    )
    static = decoder.speculative(prompt, DecodeSettings(30, temperature=1.5, seed=4), sampled_drafts=True)
    assert static.output_ids == ours.output_ids
    assert static.acceptance_lengths == ours.acceptance_lengths
    # The drafts are other tokens than the argmax ones (the confidence head reads each draft's
    # predecessor), and sampling them leaves the target's own stream of choices as it is: this
    # untrained drafter is never accepted, so both write the same sampled output.
    argmax_drafts = speculative_generate(target, drafter, prompt, DecodeSettings(30, temperature=1.5, seed=4))
    assert argmax_drafts.round_figures["confidence"] != ours.round_figures["confidence"]
    assert set(ours.accepted_drafts) == set(argmax_drafts.accepted_drafts) == {0}
    assert argmax_drafts.output_ids == ours.output_ids


def test_sampled_dspark_decoding_commits_exactly_the_targets_samples(monkeypatch):
    monkeypatch.setattr(reference, "TokenChooser", ContextKeyedSampler)
    target = tiny_target()
    drafter = loud_markov(tiny_dspark(target))
    prompt = torch.randint(0, 500, (8,)).tolist()
    plain = plain_generate(target, prompt, DecodeSettings(30, temperature=1.0)).output_ids
    for sampled in (False, True):
        result = speculative_generate(
            target, drafter, prompt, DecodeSettings(30, temperature=1.0), sampled_drafts=sampled
        )
        assert result.output_ids == plain


@pytest.mark.parametrize("arch", HYBRIDS[:1])
def test_dspark_on_a_hybrid_target_equals_plain_greedy_and_exports(arch, request, tmp_path):
    from dflash.export.contract import check_export
    from dflash.export.zlab import export_drafter

    target = family_target(arch, request)
    drafter = loud_markov(tiny_dspark(target))
    export_drafter(drafter, tmp_path)
    shape = {key: getattr(target.config, key) for key in ("num_hidden_layers", "hidden_size", "vocab_size")}
    assert check_export(tmp_path, target=shape) == []
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    prompt = torch.randint(0, 500, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = plain_generate(target, prompt, DecodeSettings(20)).output_ids
    static = decoder.speculative(prompt, DecodeSettings(20))
    assert static.output_ids == plain
    assert (
        static.acceptance_lengths
        == speculative_generate(target, drafter, prompt, DecodeSettings(20)).acceptance_lengths
    )


def test_the_confidence_tally_sets_predicted_beside_measured_acceptance():
    tally = ConfidenceTally(drafts=3)
    tally.add(
        DecodeResult(
            output_ids=[],
            accepted_drafts=[0, 3],
            round_figures={"confidence": [[0.5, 0.5, 1.0], [1.0, 0.8, 0.5]]},
        )
    )
    tally.add(
        DecodeResult(output_ids=[], accepted_drafts=[2], round_figures={"confidence": [[0.9, 1.0, 0.0]]})
    )
    tally.add(DecodeResult(output_ids=[], accepted_drafts=[1]))  # no confidence head: not counted
    fields = tally.fields()
    # survival products per round: [.5 .25 .25], [1 .8 .4], [.9 .9 0]
    assert fields["confidence_by_position"] == pytest.approx([0.8, 0.65, 0.2167], abs=1e-4)
    # rounds accepting > k drafts: k=0: 2 of 3, k=1: 2, k=2: 1
    assert fields["accepted_by_position"] == pytest.approx([2 / 3, 2 / 3, 1 / 3], abs=1e-4)
    assert fields["confidence_tau"] == pytest.approx(1 + 0.8 + 0.65 + 0.65 / 3, abs=1e-3)
    assert fields["accepted_tau"] == pytest.approx(1 + 5 / 3)
    assert ConfidenceTally(drafts=3).fields() == {}


def evaluated(
    target: FrozenTarget,
    decoders: Decoders,
    drafter: DFlashDrafter,
    prompts: PromptSet,
    *,
    temperature: float = 0.0,
    journal: EvalJournal | None = None,
) -> BenchmarkResult:
    """A prompt set through `evaluate_set` by `drafter`'s decoders: untimed, 20 new tokens, seed 0."""
    return evaluate_set(
        target,
        decoders,
        prompts,
        block_size=drafter.block_size,
        drafter=drafter,
        max_new_tokens=20,
        temperature=temperature,
        seed=0,
        timing=False,
        journal=journal,
    )


def test_the_evaluation_reports_the_confidence_head_beside_the_acceptance():
    target = tiny_target()
    drafter = loud_markov(tiny_dspark(target))
    prompts = PromptSet("random", [torch.randint(0, 500, (8,)).tolist() for _ in range(2)])
    result = evaluated(
        target, Decoders.build(target, drafter, max_len=8 + 20, graphs=False), drafter, prompts
    )
    assert result.lossless_frac == 1.0
    assert len(result.acceptance_histogram) == drafter.block_size + 2  # up to B + 1 per round
    assert len(result.confidence_by_position) == len(result.accepted_by_position) == drafter.block_size
    assert all(0 <= p <= 1 for p in result.confidence_by_position)
    report = EvalReport(results=[result])
    metrics = report.metrics()
    assert {"eval/random/confidence_tau", "eval/random/accepted_tau"} <= set(metrics)
    assert all(is_summary_metric(key) for key in metrics)
    assert "confidence head: draft k accepted, predicted / measured" in report.table()


def test_dflash_eval_of_a_deepspec_checkpoint_reports_its_confidence_head(tmp_path, tiny_chat_dir):
    """`dflash-eval ckpt=DIR` on a checkpoint in DeepSpec's published layout (bf16, the target's
    tables bundled): lossless, up to B + 1 tokens a round, the head's predictions beside the
    acceptance."""
    from dflash.config.schema import TargetConfig
    from dflash.target.model import FrozenTarget
    from dflash.tools.eval import run_eval
    from tests.test_dspark_export import write_as_deepspec_does
    from tests.test_eval import eval_cfg, write_prompts

    target = FrozenTarget.from_config(
        TargetConfig(name="t", path=str(tiny_chat_dir)), [1, 3], torch.device("cpu")
    )
    directory = write_as_deepspec_does(tmp_path / "deepspec", loud_markov(tiny_dspark(target)), target)
    prompts = {
        "math": write_prompts(tmp_path / "math.jsonl", [{"prompt": "What is two and three?"}]),
        "chat": write_prompts(tmp_path / "chat.jsonl", [{"turns": ["Tell me about the water."]}]),
    }
    report = run_eval(eval_cfg(tmp_path, tiny_chat_dir, directory, prompts, ["eval.timing=false"]))
    assert report["metrics"]["eval/lossless_frac"] == 1.0
    for result in report["results"]:
        assert len(result["acceptance_histogram"]) == 4 + 2
        assert len(result["confidence_by_position"]) == len(result["accepted_by_position"]) == 4
    assert {"eval/math/confidence_tau", "eval/chat/accepted_tau"} <= set(report["metrics"])
