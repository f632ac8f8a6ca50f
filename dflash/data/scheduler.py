"""Length buckets and the batch order (config group `scheduler`, `_target_`: a planner class),
and the held-out split the planner leaves out.

Samples fall into length buckets; batches are packed inside a bucket up to a padded-token
budget, so long buckets give small batches. The buckets and budgets are the data's
(data.bucket_edges, data.tokens_per_batch, data.block_tokens_per_batch, set by each data option
where its lengths are known); the planner class only orders the batches. The order of batches in an epoch is a pure
function of (seed, epoch): a run resumed at batch k of epoch e sees exactly what it would have.
`BatchPlanner` buckets and packs; a subclass's `order` sorts the epoch's batches:

- ShufflePlanner (scheduler=shuffle): flat shuffle of all batches (the baseline; it produces
  runs of long batches).
- InterleavePlanner (scheduler=interleave): diversity-first smooth weighted round-robin. Each
  bucket keeps its overall share of the epoch, and the next pick prefers a bucket other than
  the last one while that bucket is not behind its share.

A user's order is a subclass defining `order` (docs/extending.md), named by
`scheduler._target_=my_module.MyPlanner`.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash.config.components import build


def held_out_ids(num_samples: int, count: int, seed: int) -> np.ndarray:
    """`count` sample ids chosen by `seed` alone (sorted): the same split on every run of the
    same data, whatever the scheduler or replica count."""
    if not 0 <= count < num_samples:
        raise ValueError(
            f"data.val_samples={count} must be >= 0 and leave samples to train on ({num_samples} in the data)"
        )
    return np.sort(np.random.default_rng([seed, 0x7A1]).choice(num_samples, size=count, replace=False))


def bucket_of(length: int, edges: list[int]) -> int:
    """Index of the first edge with length < edge; the last bucket also takes length == last edge."""
    index = bisect.bisect_right(edges, length)
    return min(index, len(edges) - 1)


@dataclass(frozen=True)
class PlannedBatch:
    epoch: int
    index: int  # position in the epoch's order
    bucket: int
    sample_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockBudget:
    """What a batch costs the drafter: every sample is laid out with as many blocks as the
    batch's widest sample (padding blocks cost compute and memory too), and a sample of length n
    has at most min(num_anchors, n) anchors."""

    block_tokens_per_batch: int
    num_anchors: int
    block_size: int

    def block_tokens(self, batch_size: int, longest: int) -> int:
        return batch_size * min(self.num_anchors, longest) * self.block_size


def pack_bucket(
    sample_ids: np.ndarray,
    lengths: np.ndarray,
    tokens_per_batch: int,
    block_budget: BlockBudget | None = None,
) -> list[list[int]]:
    """Greedy packing in the given order: a batch grows while batch_size * longest <= budget
    (and, with `block_budget`, while its block tokens fit too). A sample over budget on its own
    is a batch of one. The bucket's last batch, the remainder, then takes samples from the one
    before it until the two hold about as many (see `_even_out_the_remainder`)."""

    def fits(size: int, longest: int) -> bool:
        return size * longest <= tokens_per_batch and (
            block_budget is None
            or block_budget.block_tokens(size, longest) <= block_budget.block_tokens_per_batch
        )

    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for sample_id in sample_ids:
        length = int(lengths[sample_id])
        if current and not fits(len(current) + 1, max(longest, length)):
            batches.append(current)
            current, longest = [], 0
        current.append(int(sample_id))
        longest = max(longest, length)
    if current:
        batches.append(current)
    _even_out_the_remainder(batches, lengths, fits)
    return batches


def _even_out_the_remainder(
    batches: list[list[int]], lengths: np.ndarray, fits: Callable[[int, int], bool]
) -> None:
    """Move samples from the second-to-last batch into the last until the two hold about as
    many, as far as the budget allows (the batch they leave only shrinks, so it still fits).

    Greedy packing leaves each bucket a remainder batch of any size, often one or two samples,
    and compiled graphs are specialised on sizes: torch.compile builds a new graph for a batch
    of one sample (dynamic shapes still specialise sizes 0 and 1), and inductor guards its
    kernel choices on size thresholds that a remainder far below a full batch crosses. Each
    such graph is compiled mid-run while every pipeline thread waits for it: on an H200 a
    SmolLM2 run's pipeline stood still ~50 s and ~90 s at two remainders, which replayed
    (scripts/replay_compiles.py) compiled the drafter again for 2 samples (43 s, inductor's
    `can_fuse` guard on its block tokens) and target and drafter again for 1 sample (88 s)."""
    if len(batches) < 2:
        return
    before, last = batches[-2], batches[-1]
    longest = max(int(lengths[i]) for i in last)
    while len(last) < (len(before) + len(last)) // 2:
        moved = before[-1]
        grown_longest = max(longest, int(lengths[moved]))
        if not fits(len(last) + 1, grown_longest):
            break
        last.insert(0, before.pop())
        longest = grown_longest


def interleave_order(bucket_of_batch: list[int]) -> list[int]:
    """Smooth weighted round-robin over buckets; returns batch positions in the new order."""
    queues: dict[int, list[int]] = {}
    for position, bucket in enumerate(bucket_of_batch):
        queues.setdefault(bucket, []).append(position)
    weight = {bucket: len(queue) for bucket, queue in queues.items()}
    credit = dict.fromkeys(queues, 0.0)
    order: list[int] = []
    last = None
    while len(order) < len(bucket_of_batch):
        live = [b for b in queues if queues[b]]
        total = sum(weight[b] for b in live)
        for b in live:
            credit[b] += weight[b]
        others = [b for b in live if b != last]
        best_other = max(others, key=lambda b: (credit[b], -b)) if others else None
        if best_other is not None and credit[best_other] >= 0:
            pick = best_other
        else:
            pick = max(live, key=lambda b: (credit[b], -b))
        credit[pick] -= total
        order.append(queues[pick].pop(0))
        last = pick
    return order


class BatchPlanner(ABC):
    """Plans every epoch's batches for a dataset; plans are cached and deterministic. Subclasses
    define `order`: the epoch's batch order, a pure function of the batches' buckets, the seed
    and the epoch."""

    def __init__(
        self,
        *,
        lengths: np.ndarray,
        bucket_edges: list[int],
        tokens_per_batch: int,
        block_tokens_per_batch: int | None = None,
        num_anchors: int = 1,
        block_size: int = 1,
        seed: int,
        held_out: np.ndarray | None = None,
    ):
        """block_tokens_per_batch: None, or the drafter's block tokens per batch limit, a batch's
        cost counted from its samples' anchors (`num_anchors`) x `block_size` (BlockBudget).
        held_out: sample ids never planned (the validation split); the others keep their ids."""
        self.lengths = np.asarray(lengths)
        self.trainable = np.ones(len(self.lengths), dtype=bool)
        if held_out is not None:
            self.trainable[held_out] = False
        self.edges = list(bucket_edges)
        self.tokens_per_batch = tokens_per_batch
        self.block_budget = (
            None
            if block_tokens_per_batch is None
            else BlockBudget(block_tokens_per_batch, num_anchors, block_size)
        )
        self.seed = seed
        self._plans: dict[int, tuple[PlannedBatch, ...]] = {}
        self.sample_bucket = np.array([bucket_of(int(n), self.edges) for n in self.lengths], dtype=np.int64)

    @abstractmethod
    def order(self, buckets: list[int], epoch: int) -> list[int]:
        """The epoch's batch order: positions into `buckets` (each batch's bucket, bucket by
        bucket as packed), every position once."""

    @property
    def num_buckets(self) -> int:
        return len(self.edges)

    def epoch(self, epoch: int) -> tuple[PlannedBatch, ...]:
        if epoch not in self._plans:
            self._plans[epoch] = self._plan(epoch)
        return self._plans[epoch]

    def _plan(self, epoch: int) -> tuple[PlannedBatch, ...]:
        batches: list[tuple[int, list[int]]] = []
        for bucket in range(self.num_buckets):
            members = np.flatnonzero((self.sample_bucket == bucket) & self.trainable)
            members = np.random.default_rng([self.seed, epoch, bucket]).permutation(members)
            batches += [
                (bucket, ids)
                for ids in pack_bucket(members, self.lengths, self.tokens_per_batch, self.block_budget)
            ]
        order = [int(i) for i in self.order([bucket for bucket, _ in batches], epoch)]
        if sorted(order) != list(range(len(batches))):
            raise ValueError(
                f"{type(self).__name__}.order must return each of the {len(batches)} batch positions "
                f"once, got {len(order)} positions ({len(set(order))} distinct)"
            )
        return tuple(
            PlannedBatch(epoch=epoch, index=i, bucket=batches[j][0], sample_ids=tuple(batches[j][1]))
            for i, j in enumerate(order)
        )

    def largest_batch_shapes(self, epoch: int) -> list[tuple[int, int]]:
        """Per bucket the epoch uses, the collated shape (samples, longest sample) of its batch
        with the most padded tokens: what a warm-up runs so that kernels are tuned and graphs
        compiled for the shapes training will meet, and only those (a bucket with no samples
        costs no compile)."""
        largest: dict[int, tuple[int, int]] = {}
        for plan in self.epoch(epoch):
            shape = (len(plan.sample_ids), int(self.lengths[list(plan.sample_ids)].max()))
            if plan.bucket not in largest or shape[0] * shape[1] > math.prod(largest[plan.bucket]):
                largest[plan.bucket] = shape
        return [largest[bucket] for bucket in sorted(largest)]

    def batches_per_epoch(self, epoch: int) -> int:
        return len(self.epoch(epoch))

    def at(self, seq: int) -> PlannedBatch:
        """The batch at global position `seq` of the schedule (epoch after epoch)."""
        epoch = 0
        while seq >= self.batches_per_epoch(epoch):
            seq -= self.batches_per_epoch(epoch)
            epoch += 1
        return self.epoch(epoch)[seq]


class ShufflePlanner(BatchPlanner):
    """scheduler=shuffle: a flat shuffle of the epoch's batches, seeded by (seed, epoch)."""

    def order(self, buckets: list[int], epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(len(buckets)).tolist()


class InterleavePlanner(BatchPlanner):
    """scheduler=interleave: buckets interleaved by smooth weighted round-robin (`interleave_order`)."""

    def order(self, buckets: list[int], epoch: int) -> list[int]:
        return interleave_order(buckets)


def build_planner(
    node: Any,
    *,
    data: Any,
    lengths: np.ndarray,
    seed: int,
    num_anchors: int,
    block_size: int,
    held_out: np.ndarray | None = None,
) -> BatchPlanner:
    """The `scheduler` node's planner over samples of `lengths`, packed as the `data` node says
    (its block budget counted with the drafter's anchors and block size); training, its tools
    and its tests build it so."""
    return build(
        node,
        "scheduler",
        lengths=lengths,
        bucket_edges=list(data.bucket_edges),
        tokens_per_batch=data.tokens_per_batch,
        block_tokens_per_batch=data.block_tokens_per_batch,
        seed=seed,
        num_anchors=num_anchors,
        block_size=block_size,
        held_out=held_out,
    )
