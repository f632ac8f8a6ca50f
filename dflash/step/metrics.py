"""A drafter step's metrics accumulated on the device and handed to the host without a sync.

`StepMetrics.add` sums each step's loss, accuracy counts and gradient norm into one device
vector (laid out by `MetricLayout`); `publish()` copies it into a pinned host buffer with a
non-blocking copy and returns a `MetricWindow`, which the logger reads once its event completed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.data.collate import Batch
from dflash.step.loss import LossStats


@dataclass(frozen=True)
class MetricLayout:
    """Where each sum sits in a window's flat vector (one vector: one device->host copy, one
    collective across processes). A step whose loss or gradient was not finite adds only to
    `nonfinite` (its update was skipped)."""

    block_size: int
    num_buckets: int
    # The drafter variant's name (dflash/step/variant.py): `dspark` predicts from every block
    # position (per-position sums are indexed by the predicted token's offset after the anchor,
    # 1..block_size; index 0 stays empty) and adds its loss terms and target-probability sums.
    variant: str = "dflash"
    weighted_ce: int = 0
    weight: int = 1
    grad_norm: int = 2  # sum over steps
    nonfinite: int = 3  # steps skipped
    accepted: int = 4  # blocks' leading runs of correct predictions (loss.block_acceptance)
    blocks: int = 5  # blocks whose first prediction is supervised
    rounds: int = 6  # sum over those blocks of 1 / (1 + leading run) (loss.tau_from_rounds)

    @property
    def dspark(self) -> bool:
        return self.variant == "dspark"

    @property
    def positions(self) -> int:
        """Entries of a per-position sum: index j = the j-th token after the anchor (DFlash:
        block position j, 0 the anchor; DSpark: block position j - 1)."""
        return self.block_size + (1 if self.dspark else 0)

    @property
    def correct(self) -> slice:  # per predicted position
        return slice(7, 7 + self.positions)

    @property
    def counted(self) -> slice:  # per predicted position
        return slice(self.correct.stop, self.correct.stop + self.positions)

    @property
    def bucket_weighted_ce(self) -> slice:
        return slice(self.counted.stop, self.counted.stop + self.num_buckets)

    @property
    def bucket_weight(self) -> slice:
        return slice(self.bucket_weighted_ce.stop, self.bucket_weighted_ce.stop + self.num_buckets)

    # DSpark's sums (dflash/step/dspark_loss.py: DSparkLossStats), after the buckets: scalars,
    # then per predicted position the soft acceptance and the confidence head's prediction.
    DSPARK_SCALARS = (
        "ce",
        "l1",
        "confidence_loss",
        "prob_accepted",
        "confidence_abs_error",
        "confidence_bias",
        "confidence_cumprod_bias",
    )
    DSPARK_PER_POSITION = ("soft_accepted", "confidence_predicted")

    def dspark_scalar(self, name: str) -> int:
        return self.bucket_weight.stop + self.DSPARK_SCALARS.index(name)

    def dspark_per_position(self, name: str) -> slice:
        start = self.bucket_weight.stop + len(self.DSPARK_SCALARS)
        start += self.DSPARK_PER_POSITION.index(name) * self.positions
        return slice(start, start + self.positions)

    @property
    def size(self) -> int:
        if not self.dspark:
            return self.bucket_weight.stop
        return self.dspark_per_position(self.DSPARK_PER_POSITION[-1]).stop


@dataclass(kw_only=True)
class MetricWindow:
    """Host copy of one replica's sums over a log window (`values`: a MetricLayout vector)."""

    end_step: int
    steps: int
    samples: int
    real_tokens: int
    anchors: int
    buckets: list[int]  # bucket of each batch, in training order (same-bucket runs)
    lr: float
    block_size: int
    num_buckets: int
    values: torch.Tensor
    ready: torch.cuda.Event | None = None  # set while the device->host copy may be in flight
    variant: str = "dflash"

    def is_ready(self) -> bool:
        return self.ready is None or self.ready.query()

    def sums(self) -> dict[str, object]:
        v = self.values.tolist()  # a host tensor: no device sync
        at = MetricLayout(self.block_size, self.num_buckets, self.variant)
        dspark = {}
        if at.dspark:
            dspark = {name: v[at.dspark_scalar(name)] for name in at.DSPARK_SCALARS}
            dspark.update({name: v[at.dspark_per_position(name)] for name in at.DSPARK_PER_POSITION})
        return {
            "weighted_ce": v[at.weighted_ce],
            "weight": v[at.weight],
            "grad_norm": v[at.grad_norm],
            "nonfinite_steps": v[at.nonfinite],
            "accepted": v[at.accepted],
            "blocks": v[at.blocks],
            "rounds": v[at.rounds],
            "correct": v[at.correct],
            "counted": v[at.counted],
            "bucket_weighted_ce": v[at.bucket_weighted_ce],
            "bucket_weight": v[at.bucket_weight],
            **dspark,
        }


class StepMetrics:
    """Running sums over a log window, kept on the drafter's device.

    `publish()` hands the window to the host without a sync: one non-blocking copy into a pinned
    buffer plus a CUDA event the reader polls. Only `MetricWindow` values ever reach the host.
    """

    def __init__(self, block_size: int, num_buckets: int, device: torch.device, variant: str = "dflash"):
        self.block_size, self.num_buckets, self.device = block_size, num_buckets, device
        self.variant = variant
        self.layout = MetricLayout(block_size, num_buckets, variant)
        self._sums = torch.zeros(self.layout.size, device=device)
        self._reset_host()

    def _reset_host(self) -> None:
        self.steps = self.samples = self.real_tokens = self.anchors = 0
        self.buckets: list[int] = []

    def add(self, stats: LossStats, grad_norm: torch.Tensor, batch: Batch, anchors: int) -> None:
        at, sums = self.layout, self._sums
        bucket = batch.plan.bucket  # a host int: indexing by it launches no sync
        # On the device, no sync: a non-finite step (its update skipped) is counted and adds
        # nothing else, so one bad step does not turn the whole window's loss into NaN.
        finite = torch.isfinite(grad_norm.detach()) & torch.isfinite(stats.weighted_ce.detach())
        keep = finite.to(sums.dtype)
        weighted_ce = torch.where(finite, stats.weighted_ce.detach(), 0.0)
        sums[at.weighted_ce] += weighted_ce
        sums[at.weight] += stats.weight * keep
        sums[at.grad_norm] += torch.where(finite, grad_norm.detach(), 0.0)
        sums[at.nonfinite] += 1.0 - keep
        sums[at.accepted] += stats.accepted * keep
        sums[at.blocks] += stats.blocks * keep
        sums[at.rounds] += stats.rounds * keep
        # Per-position sums sit at the predicted token's offset (DSpark's position k at k + 1).
        shift = at.positions - self.block_size
        sums[at.correct.start + shift : at.correct.stop] += stats.correct * keep
        sums[at.counted.start + shift : at.counted.stop] += stats.counted * keep
        if at.dspark:
            for name in at.DSPARK_SCALARS:
                sums[at.dspark_scalar(name)] += getattr(stats, name) * keep
            for name in at.DSPARK_PER_POSITION:
                per_position = at.dspark_per_position(name)
                sums[per_position.start + shift : per_position.stop] += getattr(stats, name) * keep
        sums[at.bucket_weighted_ce.start + bucket] += weighted_ce
        sums[at.bucket_weight.start + bucket] += stats.weight * keep
        self.steps += 1
        self.samples += len(batch.plan.sample_ids)
        self.real_tokens += batch.real_tokens
        self.anchors += anchors
        self.buckets.append(bucket)

    def publish(
        self, end_step: int, lr: float, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> MetricWindow:
        """`reduce` (several processes): sums the window over the processes' replicas; the grad
        norm and the skipped steps are the same on every process, so they keep their own value."""
        sums = self._sums
        if reduce is not None:
            sums = reduce(self._sums.clone())
            for same_everywhere in (self.layout.grad_norm, self.layout.nonfinite):
                sums[same_everywhere] = self._sums[same_everywhere]
        if self.device.type == "cuda":
            host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = sums.clone(), None
        window = MetricWindow(
            end_step=end_step,
            steps=self.steps,
            samples=self.samples,
            real_tokens=self.real_tokens,
            anchors=self.anchors,
            buckets=self.buckets,
            lr=lr,
            block_size=self.block_size,
            num_buckets=self.num_buckets,
            values=host,
            ready=ready,
            variant=self.variant,
        )
        self._sums.zero_()  # same stream as the copy: ordered after it
        self._reset_host()
        return window
