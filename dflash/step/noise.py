"""Training-noise schedules (config group `noise`, `_target_`: a NoiseSchedule class).

Each schedule is a pure function of the optimizer step, so a resumed run applies exactly the
noise an uninterrupted one would, and tests can check the effect at a step inside the warmup.
A user's schedule subclasses NoiseSchedule and overrides either method (docs/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass


class NoiseSchedule:
    """No noise unless a subclass says otherwise."""

    def keep_fraction(self, step: int) -> float:
        """Share of non-anchor block positions that keep their true token at `step` (they carry
        no loss): 0 trains every position, as inference sees them."""
        return 0.0

    def feature_std(self, step: int) -> float:
        """Std of the Gaussian added to the fused context feature at `step`."""
        return 0.0


class NoNoise(NoiseSchedule):
    """noise=none, the paper's default: every non-anchor block position is MASK."""


@dataclass(frozen=True)
class MaskRampNoise(NoiseSchedule):
    """noise=mask_ramp: the share of kept true tokens ramps from `start` to 0 over `warmup_steps`,
    so training ends fully masked as at inference."""

    start: float
    warmup_steps: int

    def keep_fraction(self, step: int) -> float:
        return self.start * max(0.0, 1.0 - step / self.warmup_steps)


@dataclass(frozen=True)
class FeatureNoise(NoiseSchedule):
    """noise=feature: the feature noise's std ramps from 0 to `std` over `warmup_steps`."""

    std: float
    warmup_steps: int

    def feature_std(self, step: int) -> float:
        return self.std * min(1.0, step / self.warmup_steps)
