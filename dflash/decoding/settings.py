"""What one decode asks for, apart from the prompt: the same four settings reach the reference
decoders, the static engine and the evaluation's decoders, so they travel as one value."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeSettings:
    """`max_new_tokens`: the most tokens produced; `temperature`: 0 decodes greedily, above it the
    target's choices are sampled with a generator seeded by `seed`; `stop_ids`: tokens that end the
    output once produced (kept as its last token)."""

    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()
