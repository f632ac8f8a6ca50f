"""dflash's own decoding of a prompt beside an engine's, counted by the engine's rules.

The two count the last round(s) of a capped output differently (llama.cpp, server-context.cpp
`get_n_draft_max` and speculative.cpp `common_speculative_draft`): the engine truncates a
round's draft to the room left minus one (the bonus token fills the last place) and does not
draft at all when one token is left (a plain decode, not a verification), while dflash drafts a
full block every round and cuts the tokens it produces (`DecodeResult.accepted_drafts` is
uncut). Both produce min(accepted + 1, room) tokens a round, so with the same target outputs the
rounds line up one for one, and `engine_count` re-counts dflash's rounds as the engine counts
them. Where outputs and drafts agree, its totals equal the engine's exactly; a difference there
is a draft that differs (numerics, or a fault on one side), never the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.decoding.reference import DecodeResult


@dataclass(frozen=True)
class RoundCount:
    """Accepted drafts and verifications of one prompt's decoding, per draft position the
    rounds that accepted it (position i: rounds accepting more than i drafts)."""

    accepted: int
    verifications: int
    accepted_per_position: tuple[int, ...]

    @property
    def tau(self) -> float:
        """Tokens per verification as the engine reports it (its log's `mean len`)."""
        return 1.0 + self.accepted / self.verifications if self.verifications else 1.0


def engine_count(result: DecodeResult, *, max_new_tokens: int, drafts_per_round: int) -> RoundCount:
    """dflash's rounds of `result` counted by the engine's cap rule (module docstring)."""
    produced = 1  # the first token comes from the prefill, without a draft on either side
    accepted_total, verifications = 0, 0
    per_position = [0] * drafts_per_round
    for accepted, length in zip(result.accepted_drafts, result.acceptance_lengths):
        room = max_new_tokens - produced
        if room > 1:
            kept = min(accepted, drafts_per_round, room - 1)
            accepted_total += kept
            verifications += 1
            for position in range(kept):
                per_position[position] += 1
        produced += length
    return RoundCount(accepted_total, verifications, tuple(per_position))


@dataclass(frozen=True)
class PromptAgreement:
    """One prompt: the same target output on both sides, and whether the accepted drafts (and
    verifications) agree when dflash's rounds are counted by the engine's rules."""

    same_output: bool
    own: RoundCount
    served: RoundCount

    @property
    def accepted_difference(self) -> int:
        return self.served.accepted - self.own.accepted

    @property
    def drafts_agree(self) -> bool:
        return self.own == self.served


def agreement(
    own: RoundCount, served: RoundCount, *, own_output: list[int], served_output: list[int]
) -> PromptAgreement:
    return PromptAgreement(same_output=own_output == served_output, own=own, served=served)
