"""Length buckets, token-budget packing, and the shuffle / interleave batch orders."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from dflash.data.scheduler import (
    BatchPlanner,
    BlockBudget,
    InterleavePlanner,
    ShufflePlanner,
    bucket_of,
    pack_bucket,
)

PLANNERS = {"shuffle": ShufflePlanner, "interleave": InterleavePlanner}


def planner(kind: str, lengths, edges=(48, 80, 128), budget=512, seed=0) -> BatchPlanner:
    return PLANNERS[kind](
        lengths=np.asarray(lengths), bucket_edges=list(edges), tokens_per_batch=budget, seed=seed
    )


def longest_run(buckets: list[int]) -> int:
    return max(len(list(group)) for _, group in itertools.groupby(buckets))


def test_bucket_edges_upper_exclusive_last_inclusive():
    edges = [48, 80, 128]
    assert [bucket_of(n, edges) for n in (1, 47, 48, 79, 80, 127, 128)] == [0, 0, 1, 1, 2, 2, 2]


def test_packing_respects_the_padded_token_budget():
    lengths = np.array([30, 40, 50, 20, 60, 10])
    batches = pack_bucket(np.arange(6), lengths, tokens_per_batch=120)
    assert sorted(itertools.chain(*batches)) == list(range(6))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * max(lengths[batch]) <= 120


@pytest.mark.parametrize("kind", ["shuffle", "interleave"])
def test_each_batch_once_deterministic_per_seed_and_epoch(kind):
    lengths = np.random.default_rng(0).integers(10, 129, size=400)
    plan = planner(kind, lengths)
    epoch0 = plan.epoch(0)
    assert sorted(itertools.chain(*(b.sample_ids for b in epoch0))) == list(range(400))
    assert all(bucket_of(int(lengths[s]), [48, 80, 128]) == b.bucket for b in epoch0 for s in b.sample_ids)
    again = planner(kind, lengths).epoch(0)
    assert [b.sample_ids for b in again] == [b.sample_ids for b in epoch0]  # resumable mid-epoch
    assert [b.sample_ids for b in plan.epoch(1)] != [b.sample_ids for b in epoch0]
    assert [b.index for b in epoch0] == list(range(len(epoch0)))


def test_interleave_breaks_same_bucket_runs_and_keeps_each_share():
    # One bucket holds ~52% of the batches, as in the run that produced the "fluffy" loss.
    rng = np.random.default_rng(1)
    lengths = np.concatenate(
        [rng.integers(10, 47, 600), rng.integers(48, 79, 300), rng.integers(80, 128, 480)]
    )
    shuffled = [b.bucket for b in planner("shuffle", lengths, budget=256).epoch(0)]
    interleaved = [b.bucket for b in planner("interleave", lengths, budget=256).epoch(0)]
    assert Counter(shuffled) == Counter(interleaved)
    share = Counter(interleaved)
    assert max(share.values()) / len(interleaved) > 0.5
    assert longest_run(interleaved) <= 2 < longest_run(shuffled)
    # Shares hold over the whole epoch, not only at its end: every prefix tracks them.
    n = len(interleaved)
    for t in range(10, n, 10):
        prefix = Counter(interleaved[:t])
        for bucket, total in share.items():
            assert abs(prefix[bucket] - total * t / n) <= 2


def test_block_budget_bounds_what_the_drafter_computes():
    """Short samples pack many to a batch by tokens, but each brings up to num_anchors blocks:
    the block budget caps batch_size x the widest sample's anchors x block_size."""
    lengths = np.array([100] * 40 + [3000, 2900, 20, 10])
    budget = BlockBudget(block_tokens_per_batch=8192, num_anchors=512, block_size=16)
    batches = pack_bucket(np.arange(len(lengths)), lengths, tokens_per_batch=16384, block_budget=budget)
    assert sorted(itertools.chain(*batches)) == list(range(len(lengths)))
    for batch in batches:
        longest = int(max(lengths[batch]))
        assert len(batch) == 1 or len(batch) * min(512, longest) * 16 <= 8192
    assert max(len(b) for b in batches) == 5  # 5 x 100 anchors x 16 = 8000; tokens alone allow 163
    # The 3000-token samples hold 512 anchors each: one per batch, however many tokens would fit.
    assert [3000] in [[int(lengths[i]) for i in b] for b in batches]
    unbounded = pack_bucket(np.arange(len(lengths)), lengths, tokens_per_batch=16384)
    assert max(len(b) for b in unbounded) > 5


def test_a_block_budget_below_one_sample_is_refused(make_cfg):
    from dflash.run.launch import build_run

    with pytest.raises(ValueError, match=r"data.block_tokens_per_batch=64 is below one sample's blocks"):
        build_run(make_cfg(["data.block_tokens_per_batch=64"]))


def test_warm_up_shapes_are_the_planned_batches_largest_per_used_bucket():
    """The asynchronous warm-up runs the target at these shapes: each is a real batch's collated
    shape (samples, longest sample), the bucket's batch with the most padded tokens; a bucket
    no sample falls in gets none, and data of one length gets exactly its one shape."""
    lengths = [20, 30, 44, 47, 60, 70, 79, 40, 33]  # buckets 0 and 1 of (48, 80, 128); 2 is empty
    plan = planner("interleave", lengths, budget=160)
    shapes = plan.largest_batch_shapes(0)
    collated = {}
    for batch in plan.epoch(0):
        shape = (len(batch.sample_ids), max(lengths[i] for i in batch.sample_ids))
        collated.setdefault(batch.bucket, []).append(shape)
    assert shapes == [max(collated[b], key=lambda s: s[0] * s[1]) for b in sorted(collated)]
    assert len(shapes) == 2  # no shape for the empty bucket
    fixed = planner("interleave", [100] * 12, budget=512)
    assert fixed.largest_batch_shapes(0) == [(5, 100)]  # 12 samples of 100 in 512 tokens: 5, 5, 2


def test_a_buckets_remainder_batch_is_evened_out_with_the_one_before_it():
    """Greedy packing leaves a remainder batch of any size; a one- or two-sample batch costs a
    compile mid-run (graphs specialise size 1, inductor guards size thresholds), so the
    remainder takes samples from the batch before it until the two hold about as many."""
    lengths = np.full(21, 10)
    batches = pack_bucket(np.arange(21), lengths, tokens_per_batch=100)
    assert [len(b) for b in batches] == [10, 6, 5]
    assert sorted(itertools.chain(*batches)) == list(range(21))
    # In a planned epoch: no batch of one in a bucket that holds more than one sample.
    rng = np.random.default_rng(3)
    plan = planner("interleave", rng.integers(10, 129, size=301), budget=512).epoch(0)
    sizes = Counter(len(b.sample_ids) for b in plan)
    assert 1 not in sizes and min(sizes) >= 2


def test_evening_out_never_breaks_the_budget():
    """The remainder [60] cannot take a 30-token sample under a 100-token budget (2 x 60 > 100):
    it stays a batch of one rather than go over."""
    lengths = np.array([30, 30, 30, 30, 60])
    batches = pack_bucket(np.arange(5), lengths, tokens_per_batch=100)
    assert batches == [[0, 1, 2], [3], [4]]
    for batch in batches:
        assert len(batch) * max(lengths[batch]) <= 100
