"""A drafter step's metrics accumulated on the device and handed to the host without a sync.

`StepMetrics.add` sums each step's loss, accuracy counts and gradient norm into one device
vector (laid out by `MetricLayout` from `FIELDS`); `publish()` copies it into a pinned host buffer
with a non-blocking copy and returns a `MetricWindow`, which the logger reads once its event
completed. A new training metric is one `Field` in `FIELDS` (docs/extending.md, "Add a training
metric"): its place in the vector, its window sum and its `train/` key all follow from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from dflash.data.collate import Batch
from dflash.models.variants import registered_drafters
from dflash.step.loss import LossStats

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


# A DSpark run's sums after DFlash's (dflash/step/dspark_loss.py: DSparkLossStats); their
# figures (per unit of weight, per position, tau_prob) are `loss.dspark_figures`'.
DSPARK_FIELDS: tuple[Field, ...] = (
    Field("ce"),  # sum_k w_k CE_k
    Field("l1"),  # sum_k w_k L1_k (2 TV)
    Field("confidence_loss"),
    Field("prob_accepted"),  # expected accepted drafts per block, summed over blocks
    Field("confidence_abs_error"),
    Field("confidence_bias"),
    Field("confidence_cumprod_bias"),
    Field("soft_accepted", width="position"),
    Field("confidence_predicted", width="position"),
)


# A DFlash2 run's sums after DFlash's (dflash/step/dflash2_loss.py: DFlash2LossStats); their
# figures are `loss.dflash2_figures`'.
DFLASH2_FIELDS: tuple[Field, ...] = (
    Field("ce"),  # sum_k w_k CE_k (the unary term)
    Field("selector_ce"),  # sum_k w_k SEL_k
    Field("candidate_hits"),
    Field("candidate_mass"),
    Field("selector_changed"),
    Field("selector_changed_correct"),
    Field("unary_accepted"),
    Field("unary_rounds"),
    Field("oracle_accepted"),
    Field("oracle_rounds"),
    Field("unary_correct", width="position"),
)

# A LiLiCorr run's sums after DFlash's (dflash/step/lilicorr_loss.py: LiLiCorrLossStats); their
# figures are `loss.lilicorr_figures`'.
LILICORR_FIELDS: tuple[Field, ...] = tuple(
    Field(name)
    for name in (
        "ce",
        "lattice_ce",
        "lattice_margin",
        "lattice_penalty",
        "lattice_slots",
        "top1_accepted",
        "top1_rounds",
        "oracle_accepted",
        "oracle_rounds",
    )
)

_VARIANT_FIELDS = {"dspark": DSPARK_FIELDS, "dflash2": DFLASH2_FIELDS, "lilicorr": LILICORR_FIELDS}


def metric_fields(variant: str = "dflash") -> tuple[Field, ...]:
    """The variant's fields: `FIELDS` as it is now (read at call time, so an extended tuple
    reaches every reader), then the variant's own."""
    return FIELDS + _VARIANT_FIELDS.get(variant, ())


@dataclass(frozen=True)
class MetricLayout:
    """Where each field's sums sit in a window's flat vector: the fields in order, each as wide
    as its `width` says."""

    block_size: int
    num_buckets: int
    # The drafter variant's name (dflash/step/variant.py): `dspark` predicts from every block
    # position, so a "position" field is indexed by the predicted token's offset after the
    # anchor, 1..block_size (index 0 stays empty), and its own fields follow DFlash's.
    variant: str = "dflash"
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
        """Entries of a "position" field: index j = the j-th token after the anchor (DFlash: block
        position j, 0 the anchor; DSpark: block position j - 1)."""
        return registered_drafters()[self.variant].drafts_for(self.block_size) + 1

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
    variant: str = "dflash"
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
        step = {f.name: getattr(stats, f.name).detach() for f in dataclasses.fields(stats)}
        kept = {name: torch.where(finite, value, 0.0) for name, value in step.items()}
        kept["grad_norm"] = torch.where(finite, grad_norm.detach(), 0.0)
        kept["nonfinite_steps"] = 1.0 - finite.to(sums.dtype)
        # A step's per-position vectors are [block_size]; they sit at the predicted token's offset
        # (DSpark's position k at k + 1).
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
