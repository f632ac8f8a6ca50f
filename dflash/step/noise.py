"""Training-noise schedules (config group `noise`).

Each schedule is a pure function of the optimizer step, so a resumed run applies exactly the
noise an uninterrupted one would, and tests can check the effect at a step inside the warmup.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.config.schema import NoiseConfig, NoiseKind


@dataclass(frozen=True)
class NoiseSchedule:
    kind: NoiseKind
    start: float
    std: float
    warmup_steps: int

    @classmethod
    def from_config(cls, cfg: NoiseConfig) -> NoiseSchedule:
        return cls(cfg.kind, cfg.start, cfg.std, cfg.warmup_steps)

    def keep_fraction(self, step: int) -> float:
        """mask_ramp: share of non-anchor block positions that keep their true token (start -> 0)."""
        if self.kind is not NoiseKind.mask_ramp:
            return 0.0
        return self.start * max(0.0, 1.0 - step / self.warmup_steps)

    def feature_std(self, step: int) -> float:
        """feature: std of the Gaussian added to the fused context feature (0 -> std)."""
        if self.kind is not NoiseKind.feature:
            return 0.0
        return self.std * min(1.0, step / self.warmup_steps)
