"""DSpark's training figures: the sums its loss adds to the metric vector (after DFlash's) and the
figures computed from them. The variant hands both to every reader (dflash/step/variant.py:
`DSparkVariant.metric_fields`, `figures`); nothing else names them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash.step.loss import share, tau_from_runs
from dflash.step.metrics import Field

# The sums of dflash/step/dspark_loss.py's DSparkLossStats, after DFlash's.
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

# Reported as train/ and val/ keys, in the run summary, and what `objective` may name.
DSPARK_FIGURES = ("ce", "l1", "confidence_loss", "confidence_abs_error", "confidence_bias", "tau_prob")


def dspark_figures(sums: Mapping[str, Any]) -> dict[str, float]:
    """DSpark's terms and the figures computed from the target's probabilities (DeepSpec's
    training metrics), each divided once over the whole sum: `ce`, `l1` (the loss's distance term,
    2 TV) and `confidence_loss` per unit of position weight (`loss` is their weighted sum);
    `accept_pos_j`, the mean soft acceptance 1 - TV of the j-th draft; `tau_prob`, 1 + the
    expected accepted drafts per block under those acceptances; the confidence head's
    calibration: weighted mean |sigmoid(c) - acceptance| and its signed bias, the same for the
    prefix products, and `confidence_pos_j`, its mean prediction per position (beside accept_pos_j)."""
    weight, counted = sums["weight"], sums["counted"]

    def per_weight(name: str) -> float:
        return share(sums[name], weight)

    def per_position(name: str, label: str) -> dict[str, float]:
        return {
            f"{label}_pos_{j}": share(value, n)
            for j, (value, n) in enumerate(zip(sums[name], counted))
            if j >= 1
        }

    names = (
        "ce",
        "l1",
        "confidence_loss",
        "confidence_abs_error",
        "confidence_bias",
        "confidence_cumprod_bias",
    )
    return {
        **{name: per_weight(name) for name in names},
        "tau_prob": tau_from_runs(sums["prob_accepted"], sums["blocks"]),
        **per_position("soft_accepted", "accept"),
        **per_position("confidence_predicted", "confidence"),
    }
