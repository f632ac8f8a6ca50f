"""A drafter step's metrics accumulated on the device and handed to the host without a sync.

`StepMetrics.add` sums each step's loss, accuracy counts and gradient norm into one device
vector (laid out by `MetricLayout` from `FIELDS`); `publish()` copies it into a pinned host buffer
with a non-blocking copy and returns a `MetricWindow`, which the logger reads once its event
completed. A new training metric is one `Field` in `FIELDS` (docs/extending.md, "Add a training
metric"): its place in the vector, its window sum and its `train/` key all follow from it. A
drafter variant's own sums follow DFlash's, declared on the variant (dflash/step/variant.py:
`metric_fields`); nothing here knows a variant by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from dflash.data.collate import Batch
from dflash.step.loss import LossStats

if TYPE_CHECKING:  # the variants declare their fields with `Field`: they import this module
    from dflash.step.variant import DFlashVariant

Width = Literal["one", "position", "bucket"]


@dataclass(frozen=True)
class Field:
    """One sum of the metric vector.

    name: its key in `MetricWindow.sums()`. source: the per-step value it sums (default: `name`):
    a `LossStats` field, `grad_norm`, or `nonfinite_steps` (1 for a skipped step). A step whose
    loss or gradient was not finite adds only to `nonfinite_steps` (its update was skipped).
    width: "one" number, one per block "position" (`block_size`), or one per length "bucket"
    (the step's value lands in its batch's bucket).
    per: report the window's sum as `train/<name>`, divided by the steps of a replica ("step")
    or by the sum of another field (its name); None: the sum only feeds other figures.
    same_everywhere: equal on every process (left out of the sum over processes).
    console: also printed on the console line.
    """

    name: str
    source: str = ""
    width: Width = "one"
    per: str | None = None
    same_everywhere: bool = False
    console: bool = False

    @property
    def value(self) -> str:
        return self.source or self.name


# The metric vector, in order. One vector: one device->host copy and one collective per window.
FIELDS: tuple[Field, ...] = (
    Field("weighted_ce"),  # sum_k w_k * CE_k
    Field("weight"),  # sum of loss weights
    Field("grad_norm", per="step", same_everywhere=True, console=True),
    Field("nonfinite_steps", same_everywhere=True),  # steps skipped
    Field("accepted"),  # blocks' leading runs of correct predictions (loss.block_acceptance)
    Field("blocks"),  # blocks whose first prediction is supervised
    Field("rounds"),  # sum over those blocks of 1 / (1 + leading run) (loss.tau_from_rounds)
    Field("correct", width="position"),
    Field("counted", width="position"),
    Field("bucket_weighted_ce", source="weighted_ce", width="bucket"),
    Field("bucket_weight", source="weight", width="bucket"),
)


def metric_fields(variant: DFlashVariant | None = None) -> tuple[Field, ...]:
    """The run's fields: `FIELDS` as it is now (read at call time, so an extended tuple reaches
    every reader), then the variant's own (dflash/step/variant.py: `metric_fields`; None: plain
    DFlash, none)."""
    return FIELDS + (variant.metric_fields if variant is not None else ())


@dataclass(frozen=True)
class MetricLayout:
    """Where each field's sums sit in a window's flat vector: the fields in order, each as wide
    as its `width` says."""

    block_size: int
    num_buckets: int
    # The drafter variant (dflash/step/variant.py; None: plain DFlash): its own fields follow
    # DFlash's, and a "position" field is indexed by the predicted token's offset after the
    # anchor, so a variant whose block positions predict the token after them (`label_offset`
    # 1) has one entry more (index 0 stays empty).
    variant: DFlashVariant | None = None
    fields: tuple[Field, ...] = ()  # empty: `metric_fields(variant)`

    slices: dict[str, slice] = dataclasses.field(init=False, repr=False, compare=False)
    size: int = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not self.fields:
            object.__setattr__(self, "fields", metric_fields(self.variant))
        widths = {"one": 1, "position": self.positions, "bucket": self.num_buckets}
        slices, start = {}, 0
        for field in self.fields:
            slices[field.name] = slice(start, start + widths[field.width])
            start += widths[field.width]
        object.__setattr__(self, "slices", slices)
        object.__setattr__(self, "size", start)

    @property
    def positions(self) -> int:
        """Entries of a "position" field: index j = the j-th token after the anchor (block position
        j - label_offset; with label_offset 0, position 0 is the anchor)."""
        return self.block_size + (self.variant.label_offset if self.variant is not None else 0)

    def __getitem__(self, name: str) -> slice:
        return self.slices[name]


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
    variant: DFlashVariant | None = None  # the drafter variant (dflash/step/variant.py; None: plain DFlash)
    ready: torch.cuda.Event | None = None  # set while the device->host copy may be in flight

    def is_ready(self) -> bool:
        return self.ready is None or self.ready.query()

    def sums(self) -> dict[str, object]:
        """Each field's sum by name: a float for a "one" field, a list of floats otherwise."""
        v = self.values.tolist()  # a host tensor: no device sync
        at = MetricLayout(self.block_size, self.num_buckets, self.variant)
        return {
            field.name: v[at[field.name]] if field.width != "one" else v[at[field.name].start]
            for field in at.fields
        }


class StepMetrics:
    """Running sums over a log window, kept on the drafter's device.

    `publish()` hands the window to the host without a sync: one non-blocking copy into a pinned
    buffer plus a CUDA event the reader polls. Only `MetricWindow` values ever reach the host.
    """

    def __init__(
        self, block_size: int, num_buckets: int, device: torch.device, variant: DFlashVariant | None = None
    ):
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
        step = {f.name: getattr(stats, f.name).detach() for f in dataclasses.fields(stats)}
        kept = {name: torch.where(finite, value, 0.0) for name, value in step.items()}
        kept["grad_norm"] = torch.where(finite, grad_norm.detach(), 0.0)
        kept["nonfinite_steps"] = 1.0 - finite.to(sums.dtype)
        # A step's per-position vectors are [block_size]; they sit at the predicted token's offset
        # (position k at k + label_offset).
        shift = at.positions - self.block_size
        for field in at.fields:
            where = at[field.name]
            if field.width == "bucket":
                where = where.start + bucket
            elif field.width == "position":
                where = slice(where.start + shift, where.stop)
            sums[where] += kept[field.value]
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
            for field in self.layout.fields:
                if field.same_everywhere:
                    sums[self.layout[field.name]] = self._sums[self.layout[field.name]]
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
            variant=self.variant,
            ready=ready,
        )
        self._sums.zero_()  # same stream as the copy: ordered after it
        self._reset_host()
        return window
