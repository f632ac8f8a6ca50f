"""What a drafter variant's per-round figures are recorded on, and how an evaluation tallies them
(the contract `DFlashDrafter.round_tally` and `add_round_figures` answer; written out in
DFlashDrafter's docstring). The evaluation sums every prompt's decoding into one tally of the
drafter's own class and reports its fields beside tau, never asking which variant drafted; a
sweep's `objective` may name them and the evaluation table prints them, both by asking the
registered drafters' tallies.

Nothing here names a figure: each tally reads the figures its drafter records, under the names
its `figures` lists, and reports the fields its `reports` lists."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol


class DecodedRounds(Protocol):
    """A decoding's rounds as a tally reads them (dflash.decoding.reference.DecodeResult)."""

    # Per round: drafts accepted (before the bonus).
    accepted_drafts: list[int]
    # Per figure name, one entry per round that recorded it.
    round_figures: dict[str, list]

    def record_round(self, figures: Mapping[str, Any]) -> None: ...


class TalliedResult(Protocol):
    """An evaluation's result at one benchmark and temperature as a tally's table lines read it
    (dflash.eval.results.BenchmarkResult)."""

    benchmark: str
    temperature: float

    def tallied_figures(self) -> dict[str, Any]:
        """The fields a round tally filled, by name."""
        ...


class RoundTally(Protocol):
    """A drafter's per-round figures over an evaluation's decodings at one temperature: built
    with the drafter's drafts per round, `add` each decoding, `fields` the evaluation result's
    figures ({} when no round recorded any).

    Optionally a classmethod `table_lines(results: Sequence[TalliedResult]) -> list[str]`: its
    section of the evaluation table (a title line, then a line per result), given the results
    holding any of its `reports`. A tally without one has its fields listed under the table's
    "the drafter's own figures:", as `name value`."""

    # The round figures it reads, by the names the drafter records them under.
    figures: ClassVar[tuple[str, ...]]
    # Every field `fields` may report, by name, known before any evaluation: each number among
    # them is a per-benchmark figure of the evaluation's metrics (`eval/<benchmark>/<name>`,
    # `_t<temperature>` appended past greedy), so a sweep's `objective` may name it.
    reports: ClassVar[tuple[str, ...]]
    # Optionally `per_position: ClassVar[tuple[str, ...]]`: those of `reports` that are lists (a
    # figure per draft position), in the result and the table but never a metric or an objective.

    def __init__(self, drafts: int) -> None: ...

    def add(self, result: DecodedRounds) -> None: ...

    def fields(self) -> dict[str, Any]: ...
