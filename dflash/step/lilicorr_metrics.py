"""LiLiCorr's training figures: the sums its loss adds to the metric vector (after DFlash's) and
the figures computed from them. The variant hands both to every reader
(dflash/step/lilicorr_variant.py: `LiLiCorrVariant.metric_fields`, `figures`); nothing else names
them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash.step.candidate_taus import candidate_tau_fields, candidate_tau_names, candidate_taus
from dflash.step.loss import share
from dflash.step.metrics import Field

# The sums of dflash/step/lilicorr_loss.py's LiLiCorrLossStats, after DFlash's.
LILICORR_FIELDS: tuple[Field, ...] = (
    Field("ce"),  # sum_k w_k CE_k (the backbone's term)
    Field("lattice_ce"),  # summed over supervised slots
    Field("lattice_margin"),
    Field("lattice_penalty"),
    Field("lattice_slots"),  # supervised slots
    # The backbone argmax's and the oracle's (slots whose true token is a candidate) runs and rounds.
    *candidate_tau_fields("top1"),
)

# Reported as train/ and val/ keys, in the run summary, and what `objective` may name.
LILICORR_FIGURES = (
    "ce",
    "lattice_ce",
    "lattice_margin",
    "lattice_penalty",
    *candidate_tau_names("top1"),
)


def lilicorr_figures(sums: Mapping[str, Any]) -> dict[str, float]:
    """LiLiCorr's figures: `ce`, DFlash's term per unit of position weight; the lattice's CE,
    hinge and distractor penalty per supervised slot; `top1_tau_*`, what the backbone's argmax
    would reach, and `oracle_tau_*`, every slot of the prefix with its label among the
    candidates. The standard acc and tau_* score the greedy walk's picks (the served decision
    path)."""
    slots = sums["lattice_slots"]
    return {
        "ce": share(sums["ce"], sums["weight"]),
        **{name: share(sums[name], slots) for name in ("lattice_ce", "lattice_margin", "lattice_penalty")},
        **candidate_taus(sums, "top1"),
    }
