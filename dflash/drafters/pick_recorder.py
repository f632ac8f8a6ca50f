"""A drafter whose head re-picks among the backbone's candidates (DFlash2's candidate selector,
LiLiCorr's lattice walk): its per-round figures (where the pick changed the backbone's own
argmax, and how those drafts fared) and their tally over an evaluation
(dflash.drafters.round_tally.RoundTally)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from dflash.drafters.round_tally import DecodedRounds, TalliedResult

# The round figures, per round (`selector_outcome`): draft positions where the pick is not the
# unary argmax; how many of those drafts were accepted; at how many of them the unary token was
# the target's choice (a rejected change that keeping the unary token would have had accepted).
SELECTOR_ROUND_FIGURES = ("selector_changed", "selector_changed_accepted", "selector_changed_unary_right")


def selector_outcome(
    *, draft: list[int], unary: list[int], choices: list[int], accepted: int
) -> tuple[int, int, int]:
    """One round's selector figures: (positions where the draft is not the unary argmax, those
    among the `accepted` drafts, and those where the unary token equals the target's choice).
    Only the first rejected position can be the last kind: before it every draft is the target's
    choice, and after it the target chose given another prefix."""
    changed = [d != u for d, u in zip(draft, unary)]
    unary_right = accepted < len(draft) and unary[accepted] == choices[accepted]
    return sum(changed), sum(changed[:accepted]), int(unary_right)


class SelectorTally:
    """A candidate selector against the unary argmax it may override, over rounds: the share of
    draft positions where it drafted another token; of those drafts, the share accepted and the
    share rejected where the unary token was the target's choice (keeping it would have had that
    draft accepted)."""

    figures: ClassVar[tuple[str, ...]] = SELECTOR_ROUND_FIGURES
    reports: ClassVar[tuple[str, ...]] = (
        "selector_change_frac",
        "selector_change_accepted_frac",
        "selector_change_unary_frac",
    )

    def __init__(self, drafts: int):
        self.drafts = drafts
        self.rounds = self.changed = self.accepted = self.unary_right = 0

    def add(self, result: DecodedRounds) -> None:
        changed, accepted, unary_right = (
            result.round_figures.get(name, []) for name in SELECTOR_ROUND_FIGURES
        )
        self.rounds += len(changed)
        self.changed += sum(changed)
        self.accepted += sum(accepted)
        self.unary_right += sum(unary_right)

    def fields(self) -> dict[str, Any]:
        """The evaluation result's selector fields ({} when no round recorded a pick; the two
        shares of changes None when the selector changed nothing)."""
        if not self.rounds:
            return {}
        return {  # as `reports` names them
            "selector_change_frac": round(self.changed / (self.rounds * self.drafts), 4),
            "selector_change_accepted_frac": round(self.accepted / self.changed, 4) if self.changed else None,
            "selector_change_unary_frac": round(self.unary_right / self.changed, 4) if self.changed else None,
        }

    @classmethod
    def table_lines(cls, results: Sequence[TalliedResult]) -> list[str]:
        """The evaluation table's section: per result, the share of drafts changed and how the
        changes fared."""
        lines = [
            "candidate selector: drafts changed from the unary argmax (share of draft positions); "
            "of those, accepted / rejected where the unary token was the target's:"
        ]
        for result in results:
            figures = result.tallied_figures()
            lines.append(
                f"  {result.benchmark} t={result.temperature:g}  changed {figures['selector_change_frac']:.1%}  "
                f"accepted {_share(figures.get('selector_change_accepted_frac'))}  "
                f"unary right {_share(figures.get('selector_change_unary_frac'))}"
            )
        return lines


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


class PickRecorder:
    """For a drafter whose head re-picks among the backbone's candidates: `draft_block`'s extra
    is the backbone's own argmax ("unary"), and each round records where the pick changed it and
    how those drafts fared (`SelectorTally`). Listed before DFlashDrafter in the drafter's bases."""

    round_extra: ClassVar[str | None] = "unary"
    round_tally: ClassVar[type[SelectorTally]] = SelectorTally

    def add_round_figures(self, result: DecodedRounds, extra: list | None, **outcome: Any) -> None:
        """Where the head changed the backbone's argmax, and how those drafts fared."""
        if extra is not None:
            result.record_round(dict(zip(SELECTOR_ROUND_FIGURES, selector_outcome(unary=extra, **outcome))))
