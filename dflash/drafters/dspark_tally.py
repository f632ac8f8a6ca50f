"""A DSpark confidence head's per-round figure and its tally: each round's survival
probabilities (`draft_block`'s extra, recorded under `CONFIDENCE`), set beside the acceptance
measured over an evaluation's rounds (dflash.drafters.round_tally.RoundTally)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from dflash.drafters.round_tally import DecodedRounds, TalliedResult

# The round figure: each draft's predicted probability of acceptance given that every draft
# before it was accepted (sigmoid of the head's logit).
CONFIDENCE = "confidence"


class ConfidenceTally:
    """A DSpark confidence head's predictions against the acceptance measured, over rounds: per
    block position k, the predicted probability that draft k is accepted (the product of the
    head's survival probabilities c_0..c_k, DeepSpec's reading of it) and the share of rounds that
    accepted at least k + 1 drafts."""

    figures: ClassVar[tuple[str, ...]] = (CONFIDENCE,)
    reports: ClassVar[tuple[str, ...]] = (
        "confidence_by_position",
        "accepted_by_position",
        "confidence_tau",
        "accepted_tau",
    )
    per_position: ClassVar[tuple[str, ...]] = ("confidence_by_position", "accepted_by_position")

    def __init__(self, drafts: int):
        self.predicted = np.zeros(drafts)
        self.accepted = np.zeros(drafts)
        self.rounds = 0

    def add(self, result: DecodedRounds) -> None:
        confidence = result.round_figures.get(CONFIDENCE)
        if not confidence:
            return
        survival = np.cumprod(np.asarray(confidence, dtype=np.float64), axis=1)
        self.predicted += survival.sum(axis=0)
        drafted = np.arange(len(self.accepted))
        self.accepted += (np.asarray(result.accepted_drafts)[: len(survival), None] > drafted).sum(axis=0)
        self.rounds += len(survival)

    def fields(self) -> dict[str, Any]:
        """The evaluation result's confidence fields ({} without a confidence head)."""
        if not self.rounds:
            return {}
        predicted, accepted = self.predicted / self.rounds, self.accepted / self.rounds
        return {  # as `reports` names them
            "confidence_by_position": [round(float(p), 4) for p in predicted],
            "accepted_by_position": [round(float(a), 4) for a in accepted],
            # 1 + expected accepted drafts, as predicted and as measured (rounds uncut by the
            # output's end, so beside each other rather than beside tau).
            "confidence_tau": float(1 + predicted.sum()),
            "accepted_tau": float(1 + accepted.sum()),
        }

    @classmethod
    def table_lines(cls, results: Sequence[TalliedResult]) -> list[str]:
        """The evaluation table's section: per result, each position's predicted / measured
        acceptance, and the two taus."""
        lines = ["confidence head: draft k accepted, predicted / measured (share of rounds):"]
        for result in results:
            figures = result.tallied_figures()
            cells = " ".join(
                f"{k}:{p:.2f}/{a:.2f}"
                for k, (p, a) in enumerate(
                    zip(figures["confidence_by_position"], figures["accepted_by_position"])
                )
            )
            lines.append(
                f"  {result.benchmark} t={result.temperature:g}  {cells}  "
                f"tau {figures['confidence_tau']:.3f}/{figures['accepted_tau']:.3f}"
            )
        return lines
