"""CUDA-graph decoding (dflash.decoding) on a GPU: replayed graphs give the tokens the eager
static path and transformers give, and shapes are captured once, never per token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import plain_generate
from dflash.decoding.settings import DecodeSettings
from dflash.target.model import FrozenTarget
from tests.test_dflash_rules import tiny_drafter, tiny_target
from tests.test_static_decoding import check_continuous_batching_equals_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def fp32_cuda_pair(make_drafter=tiny_drafter):
    """The tiny fp32 target on the GPU and a drafter for it (`make_drafter(target)`), in eval mode."""
    target = tiny_target()
    target.model.to("cuda")
    drafter = make_drafter(target).to("cuda").eval()
    return target, drafter


def check_graphed_equals_eager_and_plain_greedy(
    target: FrozenTarget, graphed: StaticDecoder, eager: StaticDecoder, *, prompts: int
) -> list[int]:
    """On `prompts` random prompts (6, 15, 24, ... tokens; 40 new): the graphed decoder's plain and
    speculative tokens are plain greedy's (lossless with the graphs on), and its rounds are the
    eager decoder's (acceptance lengths and the drafter's round figures). The last prompt back."""
    for seed in range(prompts):
        torch.manual_seed(seed)
        prompt = torch.randint(0, 500, (6 + 9 * seed,)).tolist()
        reference = plain_generate(target, prompt, DecodeSettings(40)).output_ids
        assert graphed.plain(prompt, DecodeSettings(40)).output_ids == reference
        spec = graphed.speculative(prompt, DecodeSettings(40))
        slow = eager.speculative(prompt, DecodeSettings(40))
        assert spec.output_ids == reference and slow.output_ids == reference
        assert spec.acceptance_lengths == slow.acceptance_lengths
        assert spec.round_figures == slow.round_figures
    return prompt


def test_graphed_decoding_equals_eager_and_plain_greedy_in_fp32():
    target, drafter = fp32_cuda_pair()
    graphed = StaticDecoder(target, drafter, max_len=128, graphs=True, kv_bucket=32)
    eager = StaticDecoder(target, drafter, max_len=128, graphs=False, kv_bucket=32)
    prompt = check_graphed_equals_eager_and_plain_greedy(target, graphed, eager, prompts=4)
    # One graph per (kind, attended-length bucket): prompts up to 33 + 40 new + a block reach
    # positions < 96, i.e. buckets 32, 64, 96 for each of the two kinds.
    assert 0 < graphed.captures <= 6
    before = graphed.captures
    graphed.speculative(prompt, DecodeSettings(40))
    graphed.plain(prompt, DecodeSettings(40))
    assert graphed.captures == before  # a shape seen before replays; nothing recaptures per token


def test_graphs_captured_at_start_up_leave_nothing_to_capture_while_decoding():
    """dflash-eval captures every shape before it times anything (Decoders.build)."""
    target, drafter = fp32_cuda_pair()
    decoder = StaticDecoder(target, drafter, max_len=100, graphs=True, kv_bucket=32)
    # 100 + a block of 16 -> 116 positions -> buckets 32, 64, 96, 128; a plain step and a round each.
    assert decoder.capture_every_shape() == 8
    torch.manual_seed(7)
    prompt = torch.randint(0, 500, (30,)).tolist()
    reference = plain_generate(target, prompt, DecodeSettings(60)).output_ids
    # the dummy capture writes are gone
    assert decoder.speculative(prompt, DecodeSettings(60)).output_ids == reference
    assert decoder.plain(prompt, DecodeSettings(60)).output_ids == reference
    assert decoder.captures == 8


@pytest.mark.parametrize("compile", [False, True])
def test_continuous_batching_with_graphs_equals_one_by_one_greedy(compile):
    """The CPU test's check with every decode step a replayed graph (and compiled first)."""
    target, _ = fp32_cuda_pair()
    batcher = check_continuous_batching_equals_greedy(
        target, max_new=24, slots=4, max_len=128, graphs=True, compile=compile, kv_bucket=32
    )
    assert 0 < batcher.step_fn.captures <= 3  # attended-length buckets 32, 64, 96


def test_compiled_graphs_decode_the_same_tokens_in_fp32():
    """torch.compile-fused steps captured as graphs (eval.compile_decoding, regen compile=true)."""
    target, drafter = fp32_cuda_pair()
    compiled = StaticDecoder(target, drafter, max_len=96, graphs=True, compile=True, kv_bucket=32)
    torch.manual_seed(5)
    prompt = torch.randint(0, 500, (20,)).tolist()
    reference = plain_generate(target, prompt, DecodeSettings(40)).output_ids
    assert compiled.plain(prompt, DecodeSettings(40)).output_ids == reference
    assert compiled.speculative(prompt, DecodeSettings(40)).output_ids == reference


def test_captured_rounds_replay_with_the_weights_loaded_after_the_capture():
    """Periodic evaluations load each snapshot into one decoder whose graphs were captured with
    an earlier one (StaticDecoder.load_drafter_weights): the replay must use the new weights."""
    target, first = fp32_cuda_pair()
    second = tiny_drafter(target).to("cuda").eval()
    with torch.no_grad():
        for parameter in second.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    torch.manual_seed(9)
    prompt = torch.randint(0, 480, (20,)).tolist()

    def replayed_drafts(decoder):
        _, features = decoder._prefill(prompt)
        decoder.drafter_cache.write(features, torch.arange(len(prompt), device="cuda").unsqueeze(0))
        decoder._set(prompt[-1], len(prompt))
        kv_len = decoder.target_cache.kv_len_for(len(prompt) + decoder.block_size)
        drafts, _ = decoder._round(decoder._ids, decoder._pos, kv_len=kv_len)
        return drafts.tolist()

    reused = StaticDecoder(target, first, max_len=64, graphs=True, kv_bucket=32)
    reused.capture_every_shape()
    before = replayed_drafts(reused)
    reused.load_drafter_weights(second)
    expected = replayed_drafts(StaticDecoder(target, second, max_len=64, graphs=True, kv_bucket=32))
    assert replayed_drafts(reused) == expected and expected != before


def fp32_cuda_hybrid(directory):
    target = FrozenTarget(AutoModelForCausalLM.from_pretrained(directory), [4, 1])
    target.model.to("cuda")
    if hasattr(target.config, "num_experts"):
        # grouped_mm, transformers' default, has no fp32 kernel on CUDA; batched_mm is capturable.
        target.model.set_experts_implementation("batched_mm")
    return target, tiny_drafter(target).to("cuda").eval()


@pytest.mark.parametrize("compile", [False, True])
def test_hybrid_graphs_decode_the_tokens_eager_decodes(tiny_qwen3_5_dir, compile):
    """A Gated DeltaNet target (Qwen3.5 layout) in the static decoder: replayed graphs (and
    compiled steps) give the eager static path's tokens and acceptance lengths, and DFlash gives
    plain greedy's tokens, with partly accepted blocks rolled back in the DeltaNet states (an
    oracle drafter wrong at a varying place); the commit is one more captured graph."""
    from tests.test_static_decoding import wrong_at

    target, drafter = fp32_cuda_hybrid(tiny_qwen3_5_dir)
    graphed = StaticDecoder(target, drafter, max_len=128, graphs=True, compile=compile, kv_bucket=32)
    eager = StaticDecoder(target, drafter, max_len=128, graphs=False, kv_bucket=32)
    block = drafter.block_size
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(0, 500, (6 + 9 * seed,)).tolist()
        plain = eager.plain(prompt, DecodeSettings(40)).output_ids
        assert graphed.plain(prompt, DecodeSettings(40)).output_ids == plain
        spec = graphed.speculative(prompt, DecodeSettings(40))
        assert spec.output_ids == plain
        assert spec.acceptance_lengths == eager.speculative(prompt, DecodeSettings(40)).acceptance_lengths
        sequence = prompt + eager.plain(prompt, DecodeSettings(40 + block)).output_ids

        def oracle(anchor_1, anchor_pos_1, *, kv_len, sequence=sequence):
            anchor = int(anchor_pos_1)  # a host read: this drafter runs eagerly, outside the graph
            drafts = torch.tensor(sequence[anchor + 1 : anchor + block], device="cuda")
            wrong = wrong_at(anchor, block)
            if wrong < block - 1:
                drafts[wrong] = (drafts[wrong] + 1) % 500
            return drafts

        for decoder in (graphed, eager):
            decoder.drafter_cache.draft = oracle
        # Graphs off for the oracle (it reads the host), on for the target's commit and steps:
        graphed._round.enabled = False
        assert graphed.speculative(prompt, DecodeSettings(40)).output_ids == plain
        graphed._round.enabled = True
        del graphed.drafter_cache.draft, eager.drafter_cache.draft
    assert graphed._commit.captures == 1


def test_hybrid_continuous_batching_with_graphs_equals_one_by_one_greedy(tiny_qwen3_next_dir):
    """Against the eager static decoder's greedy: on CUDA transformers' own path runs
    flash-linear-attention's kernels (TF32 products), the static steps the fp32 recurrence."""
    target, _ = fp32_cuda_hybrid(tiny_qwen3_next_dir)
    eager = StaticDecoder(target, max_len=160, graphs=False, kv_bucket=32)
    batcher = check_continuous_batching_equals_greedy(
        target,
        max_new=24,
        greedy=lambda _, prompt, settings: eager.plain(prompt, settings),
        slots=4,
        max_len=128,
        graphs=True,
        kv_bucket=32,
    )
    assert batcher.commit_fn.captures == 1


def test_graphed_dspark_rounds_equal_eager_ones_greedy_and_sampled():
    """A DSpark round (B drafts left to right with the Markov bias inside the graph, B + 1
    verified, the sampled drafts' noise fed in before each replay) replays what the eager
    static path computes; greedy output equals plain greedy."""
    from tests.test_dspark_decoding import loud_markov
    from tests.test_dspark_export import tiny_dspark

    target = tiny_target()
    target.model.to("cuda")
    drafter = loud_markov(tiny_dspark(target, head_type="rnn")).to("cuda")
    graphed = StaticDecoder(target, drafter, max_len=96, graphs=True, kv_bucket=32)
    eager = StaticDecoder(target, drafter, max_len=96, graphs=False, kv_bucket=32)
    # Buckets 32, 64, 96 (96 + a verification of B + 1 = 101 -> 128 too): the plain step, the
    # greedy round and the round sampled at 1.0, each.
    assert graphed.capture_every_shape((1.0,)) == 12
    torch.manual_seed(3)
    prompt = torch.randint(0, 500, (20,)).tolist()
    greedy = graphed.speculative(prompt, DecodeSettings(40))
    assert greedy.output_ids == plain_generate(target, prompt, DecodeSettings(40)).output_ids
    assert greedy.acceptance_lengths == eager.speculative(prompt, DecodeSettings(40)).acceptance_lengths
    torch.testing.assert_close(
        torch.tensor(greedy.round_figures["confidence"]),
        torch.tensor(eager.speculative(prompt, DecodeSettings(40)).round_figures["confidence"]),
    )
    sampled = graphed.speculative(prompt, DecodeSettings(40, temperature=1.0, seed=2), sampled_drafts=True)
    assert (
        sampled.output_ids
        == eager.speculative(
            prompt, DecodeSettings(40, temperature=1.0, seed=2), sampled_drafts=True
        ).output_ids
    )
    assert graphed.captures == 12


def test_graphed_dflash2_rounds_equal_eager_ones_greedy_and_sampled():
    """A DFlash2 round (the selector's top-K walk inside the graph, B verified, the sampled
    drafts' noise fed in before each replay) replays what the eager static path computes, the
    selector's figures included; greedy output equals plain greedy."""
    from tests.test_dflash2_decoding import tiny_dflash2

    target = tiny_target()
    target.model.to("cuda")
    drafter = tiny_dflash2(target).to("cuda")
    graphed = StaticDecoder(target, drafter, max_len=96, graphs=True, kv_bucket=32)
    eager = StaticDecoder(target, drafter, max_len=96, graphs=False, kv_bucket=32)
    # Buckets 32, 64, 96 (96 + a verification of B = 100 -> 128 too): the plain step, the greedy
    # round and the round sampled at 1.0, each.
    assert graphed.capture_every_shape((1.0,)) == 12
    torch.manual_seed(3)
    prompt = torch.randint(0, 500, (20,)).tolist()
    greedy = graphed.speculative(prompt, DecodeSettings(40))
    eager_greedy = eager.speculative(prompt, DecodeSettings(40))
    assert greedy.output_ids == plain_generate(target, prompt, DecodeSettings(40)).output_ids
    assert greedy.acceptance_lengths == eager_greedy.acceptance_lengths
    assert greedy.round_figures == eager_greedy.round_figures
    assert sum(greedy.round_figures["selector_changed"]) > 0
    sampled = graphed.speculative(prompt, DecodeSettings(40, temperature=1.0, seed=2), sampled_drafts=True)
    eager_sampled = eager.speculative(
        prompt, DecodeSettings(40, temperature=1.0, seed=2), sampled_drafts=True
    )
    assert sampled.output_ids == eager_sampled.output_ids
    assert sampled.round_figures == eager_sampled.round_figures
    assert graphed.captures == 12


def test_prompts_decoded_side_by_side_on_streams_decode_as_alone():
    """eval.decode_streams on a GPU: three decoders, their graphs captured up front, replayed from
    three threads on three CUDA streams: each prompt's tokens and acceptance lengths are a lone
    graphed decoder's, and nothing is captured while decoding."""
    from dflash.decoding.side_by_side import SideBySideDecoders

    target, drafter = fp32_cuda_pair()
    decoders = [StaticDecoder(target, drafter, max_len=96, graphs=True, kv_bucket=32) for _ in range(3)]
    captured = [decoder.capture_every_shape() for decoder in decoders]
    side_by_side = SideBySideDecoders(decoders)
    # Each decoder's graphs were captured on, and replay on, a stream no other decoder uses.
    assert len({id(stream) for stream in side_by_side.streams}) == 3
    assert side_by_side.streams == [decoder.stream for decoder in decoders]
    alone = StaticDecoder(target, drafter, max_len=96, graphs=True, kv_bucket=32)
    torch.manual_seed(9)
    for _ in range(3):  # the same decoders again: their caches hold the last prompts' entries
        prompts = [torch.randint(0, 500, (length,)).tolist() for length in (8, 27, 15)]
        expected = [alone.speculative(prompt, DecodeSettings(40)) for prompt in prompts]
        got = side_by_side.speculative(prompts, [DecodeSettings(40)] * 3)
        assert got == expected
        assert [r.output_ids for r in got] == [
            plain_generate(target, p, DecodeSettings(40)).output_ids for p in prompts
        ]
    assert [decoder.captures for decoder in decoders] == captured
