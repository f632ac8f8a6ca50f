"""The taus of a head that picks among candidates, beside the standard tau of the picks it
serves: what its plain `pick` alone would reach (DFlash2's unary argmax, LiLiCorr's backbone
top-1) and the oracle over its candidates (every position of the prefix with its label among
them: the most a picker over these candidates can reach). Their sums, figure names, figures
and the reason each can be undefined are written once here; each such variant's metrics
(dflash/step/dflash2_metrics.py, dflash/step/lilicorr_metrics.py) take them by its pick's name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash.step.loss import tau_from_rounds, tau_from_runs
from dflash.step.metrics import Field

ORACLE = "oracle"


def candidate_tau_fields(pick: str) -> tuple[Field, ...]:
    """The sums its loss statistics add (loss.block_acceptance's leading runs and rounds, for the
    pick's hits and for the positions whose label is a candidate)."""
    return tuple(Field(f"{who}_{sum_name}") for who in (pick, ORACLE) for sum_name in ("accepted", "rounds"))


def candidate_tau_names(pick: str) -> tuple[str, ...]:
    """The figures `candidate_taus` computes: `<pick>_tau_block`, `<pick>_tau_decode`, then the
    oracle's."""
    return tuple(f"{who}_tau_{kind}" for who in (pick, ORACLE) for kind in ("block", "decode"))


def candidate_taus(sums: Mapping[str, Any], pick: str) -> dict[str, float]:
    """tau_block and tau_decode of the pick and of the oracle from a window's summed fields."""
    figures = {}
    for who in (pick, ORACLE):
        figures[f"{who}_tau_block"] = tau_from_runs(sums[f"{who}_accepted"], sums["blocks"])
        figures[f"{who}_tau_decode"] = tau_from_rounds(sums["blocks"], sums[f"{who}_rounds"])
    return figures


def unmeasured_taus(pick: str) -> dict[str, str]:
    """Why each of those figures can be undefined: a window that measured no block."""
    return dict.fromkeys(candidate_tau_names(pick), "no block measured")
