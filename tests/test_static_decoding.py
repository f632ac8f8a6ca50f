"""The static-cache decoder (dflash.decoding): the same logits, features and tokens as the
transformers forward and the dynamic-cache decoding it replaces, for every target family users
serve (dense, MoE, and the hybrid Gated DeltaNet ones whose states roll back exactly), with graphs
off on CPU; the GPU tests in test_gpu_decoding.py replay CUDA graphs."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.decoding.continuous import ContinuousBatcher
from dflash.decoding.engine import StaticDecoder
from dflash.decoding.reference import plain_generate, speculative_generate
from dflash.decoding.sampling import Sampler
from dflash.decoding.settings import DecodeSettings
from dflash.decoding.static_target import StaticCacheTarget, static_decoding_refusal
from dflash.target.families import TARGET_FAMILIES
from dflash.target.model import FrozenTarget
from tests.conftest import TINY_ARCH
from tests.test_dflash_rules import tiny_drafter, tiny_target


def tiny_llama_target() -> FrozenTarget:
    config = AutoConfig.for_model("llama", **{**TINY_ARCH, "tie_word_embeddings": True})
    torch.manual_seed(0)
    # The last layer among the features: its output is not the final-norm output.
    return FrozenTarget(AutoModelForCausalLM.from_config(config), [3, 1])


TARGETS = {"qwen3": tiny_target, "llama": tiny_llama_target}
# Every other family the table says the static decoder runs, in its published layout saved by
# transformers (tests/conftest.py). Features from layer 4 (Gated DeltaNet in the hybrids) and 1.
SAVED = [f.model_type for f in TARGET_FAMILIES if f.static_decoding and f.model_type not in TARGETS]
HYBRIDS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


def family_target(arch: str, request) -> FrozenTarget:
    if arch in TARGETS:
        return TARGETS[arch]()
    directory = request.getfixturevalue(f"tiny_{arch}_dir")
    return FrozenTarget(AutoModelForCausalLM.from_pretrained(directory), [4, 1])


@pytest.mark.parametrize("arch", sorted(TARGETS) + SAVED)
def test_prefill_and_steps_equal_the_full_forward(arch, request):
    """Two slots of different lengths (the shorter prompt padded), a rejected block that is only
    forgotten (attention: the next tokens overwrite it; DeltaNet: nothing committed), and
    multi-token steps, each kept whole: logits and features equal one full forward each."""
    target = family_target(arch, request)
    torch.manual_seed(3)
    seqs = [torch.randint(0, 500, (40,)), torch.randint(0, 500, (40,))]
    full = [target(s[None]) for s in seqs]
    cache = StaticCacheTarget(target, slots=2, max_len=64, kv_bucket=16, features=True, max_step=4)
    lengths = [9, 5]
    ids = torch.stack([seqs[0][:9], torch.cat([seqs[1][:5], torch.zeros(4, dtype=torch.long)])])
    logits, features = cache.prefill(ids, torch.tensor([0, 1]), torch.tensor([8, 4]))
    for row, length in enumerate(lengths):
        torch.testing.assert_close(logits[row], full[row].logits[0, length - 1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            features[row, :length], full[row].features[0, :length], atol=1e-5, rtol=1e-5
        )
    # A rejected 3-token block in both slots, then real tokens over it.
    rejected = torch.tensor([[1, 2, 3], [4, 5, 6]])
    cache.step(rejected, torch.tensor([[9, 10, 11], [5, 6, 7]]), kv_len=cache.kv_len_for(12))
    cache.commit(torch.tensor([0, 0]))
    for count in (3, 1, 4):
        new = torch.stack([seqs[r][lengths[r] : lengths[r] + count] for r in range(2)])
        positions = torch.stack([torch.arange(n, n + count) for n in lengths])
        logits, features = cache.step(new, positions, kv_len=cache.kv_len_for(max(lengths) + count))
        cache.commit(torch.tensor([count, count]))
        for row, length in enumerate(lengths):
            span = slice(length, length + count)
            torch.testing.assert_close(logits[row], full[row].logits[0, span], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(features[row], full[row].features[0, span], atol=1e-5, rtol=1e-5)
        lengths = [n + count for n in lengths]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_deltanet_step_keeps_exactly_the_prefix_it_is_told(arch, request):
    """Slot 0 keeps 2 of a 4-token step, slot 1 all 4 and then 0 of the next: each continues
    as if only the kept tokens had ever been run (the state after each prefix is exact)."""
    target = family_target(arch, request)
    torch.manual_seed(4)
    seq = torch.randint(0, 500, (30,))
    full = target(seq[None])
    cache = StaticCacheTarget(target, slots=2, max_len=32, kv_bucket=16, features=True, max_step=4)
    cache.prefill(seq[None, :6].expand(2, -1), torch.tensor([0, 1]), torch.tensor([5, 5]))
    cache.step(seq[6:10].expand(2, -1), torch.arange(6, 10).expand(2, -1), kv_len=16)
    cache.commit(torch.tensor([2, 4]))
    cache.step(torch.tensor([[7, 7, 7, 7]] * 2), torch.tensor([[8, 9, 10, 11], [10, 11, 12, 13]]), kv_len=16)
    cache.commit(torch.tensor([0, 0]))
    lengths = [8, 10]
    new = torch.stack([seq[n : n + 3] for n in lengths])
    logits, features = cache.step(new, torch.stack([torch.arange(n, n + 3) for n in lengths]), kv_len=16)
    for row, length in enumerate(lengths):
        torch.testing.assert_close(logits[row], full.logits[0, length : length + 3], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features[row], full.features[0, length : length + 3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(TARGETS) + SAVED)
def test_static_plain_and_dflash_greedy_equal_transformers_greedy(arch, request):
    target = family_target(arch, request)
    drafter = tiny_drafter(target).eval()
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(0, 500, (5 + 7 * seed,)).tolist()
        reference = plain_generate(target, prompt, DecodeSettings(24)).output_ids
        assert decoder.plain(prompt, DecodeSettings(24)).output_ids == reference
        result = decoder.speculative(prompt, DecodeSettings(24))
        assert result.output_ids == reference
        assert sum(result.acceptance_lengths) == 24 - 1
        # The same drafts as the dynamic-cache decoder: the same acceptance lengths.
        assert (
            result.acceptance_lengths
            == speculative_generate(target, drafter, prompt, DecodeSettings(24)).acceptance_lengths
        )


def wrong_at(anchor: int, block: int) -> int:
    """Which draft of the round anchored at `anchor` the oracle gets wrong (>= block - 1: none)."""
    return random.Random(anchor).randrange(block + 1)


@pytest.mark.parametrize("arch", ["qwen3", *HYBRIDS])
def test_partly_accepted_drafts_roll_back_exactly(arch, request):
    """A drafter that drafts the target's own continuation with one token wrong at a place that
    changes every round: rounds accept from none to all of a block, each rollback must leave the
    target exactly after the accepted tokens (else the next round's choices drift and the
    output leaves plain greedy's)."""
    target = family_target(arch, request)
    drafter = tiny_drafter(target).eval()
    decoder = StaticDecoder(target, drafter, max_len=96, graphs=False, kv_bucket=16)
    block, max_new = drafter.block_size, 48
    torch.manual_seed(11)
    prompt = torch.randint(0, 500, (9,)).tolist()
    sequence = prompt + plain_generate(target, prompt, DecodeSettings(max_new + block)).output_ids

    def oracle(anchor_1, anchor_pos_1, *, kv_len):
        anchor = int(anchor_pos_1)
        drafts = torch.tensor(sequence[anchor + 1 : anchor + block])
        wrong = wrong_at(anchor, block)
        if wrong < block - 1:
            drafts[wrong] = (drafts[wrong] + 1) % 500
        return drafts

    decoder.drafter_cache.draft = oracle
    result = decoder.speculative(prompt, DecodeSettings(max_new))
    assert result.output_ids == sequence[len(prompt) : len(prompt) + max_new]
    expected, anchor = [], len(prompt)
    while sum(expected) < max_new - 1:
        produced = min(wrong_at(anchor, block), block - 1) + 1
        expected.append(min(produced, max_new - 1 - sum(expected)))
        anchor += produced
    assert result.acceptance_lengths == expected
    assert len(set(expected)) >= 4  # rollbacks of many lengths, all-accepted rounds included


def test_static_dflash_sampling_and_stop_tokens_follow_the_reference():
    target = tiny_target()
    drafter = tiny_drafter(target).eval()
    decoder = StaticDecoder(target, drafter, max_len=64, graphs=False, kv_bucket=16)
    prompt = torch.randint(0, 500, (10,)).tolist()
    greedy = plain_generate(target, prompt, DecodeSettings(30)).output_ids
    stop = greedy[11]
    expected = greedy[: greedy.index(stop) + 1]
    assert decoder.plain(prompt, DecodeSettings(30, stop_ids=frozenset([stop]))).output_ids == expected
    assert decoder.speculative(prompt, DecodeSettings(30, stop_ids=frozenset([stop]))).output_ids == expected
    sampled = decoder.speculative(prompt, DecodeSettings(30, temperature=1.0, seed=5))
    assert len(sampled.output_ids) == 30 and sum(sampled.acceptance_lengths) == 29
    assert decoder.plain(prompt, DecodeSettings(30, temperature=1.0, seed=5)).output_ids == (
        plain_generate(target, prompt, DecodeSettings(30, temperature=1.0, seed=5)).output_ids
    )


def test_a_prompt_beyond_the_static_cache_is_refused_with_its_size():
    target = tiny_target()
    decoder = StaticDecoder(target, max_len=32, graphs=False, kv_bucket=16)
    with pytest.raises(ValueError, match="45 tokens \\+ 8 new does not fit"):
        decoder.plain(list(range(45)), DecodeSettings(8))


def test_a_sliding_window_target_is_refused_and_keeps_the_dynamic_path():
    config = AutoConfig.for_model("mistral", **{**TINY_ARCH, "sliding_window": 16})
    target = FrozenTarget(AutoModelForCausalLM.from_config(config), [1, 3])
    assert static_decoding_refusal(target) == "a sliding attention window"
    assert StaticDecoder.for_target(target, None, max_len=32, graphs=None) is None
    for arch in ("qwen3", "llama"):
        assert static_decoding_refusal(TARGETS[arch]()) is None


def check_continuous_batching_equals_greedy(
    target, *, max_new: int, greedy=plain_generate, **batcher_options
) -> ContinuousBatcher:
    """11 prompts of different lengths through a batcher with fewer slots (refills): every reply
    is the target's one-by-one greedy continuation (`greedy(target, prompt, settings)`), up to
    (not including) a stop token some replies reach, with the right finish reason; the
    generated-token count includes the stops. Shared by the CPU test (graphs off) and the GPU
    tests (graphs, compiled)."""
    torch.manual_seed(0)
    prompts = [torch.randint(0, 500, (int(n),)).tolist() for n in torch.randint(3, 30, (11,))]
    references = [greedy(target, p, DecodeSettings(max_new)).output_ids for p in prompts]
    stop = references[1][4]
    batcher = ContinuousBatcher(
        target,
        max_new_tokens=max_new,
        stop_ids=frozenset([stop]),
        sampler=Sampler({"do_sample": False}, target.device, 0),
        **batcher_options,
    )
    for index, prompt in enumerate(prompts):
        batcher.submit(index, prompt)
    done = {}
    while batcher.busy:
        done.update({f.tag: (f.tokens, f.finish_reason) for f in batcher.step()})
    for index, reference in enumerate(references):
        if stop in reference:
            assert done[index] == (reference[: reference.index(stop)], "stop"), index
        else:
            assert done[index] == (reference, "length"), index
    assert batcher.generated_tokens == sum(
        reference.index(stop) + 1 if stop in reference else max_new for reference in references
    )
    return batcher


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_continuous_batching_equals_one_by_one_greedy_with_refills_and_prefill_groups(arch, request):
    """3 slots, prefills split into groups of <= 40 padded tokens (padding inert in DeltaNet
    states too)."""
    check_continuous_batching_equals_greedy(
        family_target(arch, request),
        max_new=16,
        slots=3,
        max_len=64,
        graphs=False,
        kv_bucket=16,
        prefill_tokens=40,
    )


def test_sampler_filters_follow_generate_semantics():
    torch.manual_seed(0)
    logits = torch.randn(64, 100)
    greedy = logits.argmax(-1)
    assert torch.equal(Sampler({"do_sample": False}, logits.device, 0)(logits), greedy)
    top1 = Sampler({"do_sample": True, "temperature": 5.0, "top_k": 1}, logits.device, 0)
    assert torch.equal(top1(logits), greedy)
    tiny_p = Sampler({"do_sample": True, "temperature": 1.0, "top_p": 1e-6}, logits.device, 0)
    assert torch.equal(tiny_p(logits), greedy)  # the most likely token always stays
    top3 = Sampler({"do_sample": True, "temperature": 1.0, "top_k": 3}, logits.device, 0)
    allowed = torch.topk(logits, 3, dim=-1).indices
    assert (top3(logits)[:, None] == allowed).any(-1).all()
    first = Sampler({"do_sample": True, "temperature": 1.0}, logits.device, 7)(logits)
    assert torch.equal(first, Sampler({"do_sample": True, "temperature": 1.0}, logits.device, 7)(logits))


class GraphCounter:
    """A torch.compile backend that runs each graph as traced (no inductor: fast on CPU) and
    counts them: what the test checks is how many graphs dynamo makes, not their kernels."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


@pytest.mark.parametrize(
    "arch,counts,most_graphs",
    [
        # Dense: one graph for one-token steps (a size-1 dimension is specialised), one for every
        # longer step: not one per layer (4 here), per step length or per attended-length bucket.
        ("qwen3", (3, 1, 4, 1, 16), 2),
        ("llama", (3, 1, 4, 1, 16), 2),
        # Hybrid, as decoding runs it (one-token steps and 4-token verifications): one graph per
        # layer kind (Gated DeltaNet, gated attention) and step length.
        ("qwen3_5", (1, 4, 1, 4, 4, 4, 4, 4, 4, 1), 4),
    ],
)
def test_regional_compile_makes_one_graph_per_layer_kind_and_step_shape_not_per_layer(
    arch, counts, most_graphs, request
):
    """`compile_backend`: every layer kind's step is one compiled function; the layers' weights
    and caches are its inputs, so the graphs do not grow with the layer count or the attended
    length, and the logits, features and (committed, partly) states are the eager step's."""
    torch._dynamo.reset()
    target = family_target(arch, request)
    torch.manual_seed(3)
    ids = torch.randint(0, 500, (2, 60))
    counter = GraphCounter()
    # kv_bucket 24: no other dimension of the tiny model has that size. torch.compile gives
    # dimensions of equal size one symbol at the first trace ("duck sizing"), so a bucket equal
    # to the head dim would cost one recompile when the attended length first differs from it.
    options = dict(slots=2, max_len=64, kv_bucket=24, features=True, max_step=max(counts))
    eager = StaticCacheTarget(target, **options)
    compiled = StaticCacheTarget(target, **options, compile_backend=counter)
    for cache in (eager, compiled):
        cache.prefill(ids[:, :9], torch.tensor([0, 1]), torch.tensor([8, 8]))
    length = 9
    for count in counts:  # the attended length crosses from the 24 to the 48 bucket
        new, positions = ids[:, length : length + count], torch.arange(length, length + count).expand(2, -1)
        kv_len = eager.kv_len_for(length + count)
        (want_logits, want_features), (logits, features) = (
            cache.step(new, positions, kv_len=kv_len) for cache in (eager, compiled)
        )
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features, want_features, atol=1e-5, rtol=1e-5)
        kept = torch.tensor([count, max(count - 2, 0)])  # slot 1 rejects part of each step
        for cache in (eager, compiled):
            cache.commit(kept)
        length += int(kept.min())
    assert len(target.model.base_model.layers) >= 4
    assert 1 <= counter.graphs <= most_graphs, counter.graphs  # >= 1: the compiled function did run


def test_bench_decode_times_a_hybrid_target_on_the_static_decoder(tiny_qwen3_5_dir, monkeypatch, capsys):
    """scripts/bench_decode.py on a Qwen3.5-layout target: the static rows (steps and rounds
    with their DeltaNet commits) and the dynamic path's (which re-runs the sequence)."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_decode.py"
    arguments = ["--reps", "2", "--context", "16", "target=hf", f"target.path={tiny_qwen3_5_dir}"]
    arguments += ["drafter=tiny", "drafter.mask_token_id=511", "gpu=cpu"]
    monkeypatch.setattr(sys, "argv", [str(script), *arguments])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    for row in ("plain step [static]", "verify (B=4) [static]", "round [static]", "round [dynamic]"):
        assert row in out, out
    # Where the steps' time goes, per layer kind (the tiny layout: 3 of each).
    for row in ("plain: 3 Gated DeltaNet layers [static]", "verify: 3 attention layers [static]"):
        assert row in out, out
    assert "static: DFlash is faster than plain decoding once tau >" in out
    # Each variant in its own plain steps: the dynamic plain step is 1.00 of itself, not a
    # multiple of the static one (a ratio across two engines).
    ratios = {line.split()[-2] for line in out.splitlines() if line.startswith("plain step [")}
    assert ratios == {"1.00"}, out


@pytest.mark.parametrize(
    ("variant", "verify_row"), [("dspark", "verify (B+1=5)"), ("dflash2", "verify (B=4)")]
)
def test_bench_decode_times_the_variants_own_draft_and_round(variant, verify_row, monkeypatch, capsys):
    """`variant=` builds that drafter; its round verifies its own length and drafts with its own
    walk (DSpark's Markov head, DFlash2's selector), not DFlash's argmax."""
    import runpy
    import sys
    from pathlib import Path

    from dflash.drafters.drafter_registry import registered_drafters

    walks = []
    for drafter_class in {registered_drafters()[name] for name in ("dspark", "dflash2")}:
        original = drafter_class.draft_block

        def recorded(self, *args, _original=original, **kwargs):
            walks.append(self.variant_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(drafter_class, "draft_block", recorded)
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_decode.py"
    arguments = ["--reps", "2", "--context", "16", "--skip-dynamic", "target=tiny", "drafter=tiny"]
    arguments += ["drafter.mask_token_id=511", "gpu=cpu", f"variant={variant}", "variant.markov_rank=8"]
    if variant == "dflash2":
        arguments[-1] = "variant.selector_rank=8"
    monkeypatch.setattr(sys, "argv", [str(script), *arguments])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert f"{verify_row} [static]" in out and "round [static]" in out, out
    assert set(walks) == {variant}, walks
