"""DFlash2's training figures: the sums its loss adds to the metric vector (after DFlash's) and
the figures computed from them. The variant hands both to every reader (dflash/step/variant.py:
`DFlash2Variant.metric_fields`, `figures`); nothing else names them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash.step.candidate_taus import candidate_tau_fields, candidate_tau_names, candidate_taus
from dflash.step.loss import share
from dflash.step.metrics import Field

# The sums of dflash/step/dflash2_loss.py's DFlash2LossStats, after DFlash's.
DFLASH2_FIELDS: tuple[Field, ...] = (
    Field("ce"),  # sum_k w_k CE_k (the unary term)
    Field("selector_ce"),  # sum_k w_k SEL_k
    Field("candidate_hits"),
    Field("candidate_mass"),
    Field("selector_changed"),
    Field("selector_changed_correct"),
    *candidate_tau_fields("unary"),  # the unary argmax's and the oracle's runs and rounds
    Field("unary_correct", width="position"),
)

# Reported as train/ and val/ keys, in the run summary, and what `objective` may name.
DFLASH2_FIGURES = (
    "ce",
    "selector_ce",
    "candidate_recall",
    "candidate_mass",
    "selector_changed",
    "selector_changed_correct",
    "unary_acc",
    *candidate_tau_names("unary"),
)


def dflash2_figures(sums: Mapping[str, Any]) -> dict[str, float]:
    """DFlash2's terms per unit of position weight (`ce`, the unary CE; `selector_ce`, the K-way
    CE), and over supervised positions: `candidate_recall` (label in the unary top-K),
    `candidate_mass` (the drafter's softmax mass on its top-K), `selector_changed` (share of picks
    that are not the unary argmax) and `selector_changed_correct` (share of those that are the
    label); `unary_acc` and `unary_tau_*` (what the unary argmax, plain DFlash's draft, would
    reach); `oracle_tau_*` (every position of the prefix with its label among the candidates: the
    most a selector over these candidates can reach). The standard acc and tau_* score the
    selector's picks (dflash/step/dflash2_loss.py)."""
    weight, supervised = sums["weight"], sum(sums["counted"][1:])

    return {
        "ce": share(sums["ce"], weight),
        "selector_ce": share(sums["selector_ce"], weight),
        "candidate_recall": share(sums["candidate_hits"], supervised),
        "candidate_mass": share(sums["candidate_mass"], supervised),
        "selector_changed": share(sums["selector_changed"], supervised),
        "selector_changed_correct": share(sums["selector_changed_correct"], sums["selector_changed"]),
        "unary_acc": share(sum(sums["unary_correct"][1:]), supervised),
        **candidate_taus(sums, "unary"),
    }
