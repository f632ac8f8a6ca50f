"""LR schedules (config group `lr_schedule`, `_target_`: one of these functions, or a user's with
the same call: (optimizer, *, total_steps, warmup_ratio) -> a torch LR scheduler stepped once per
optimizer step)."""

from __future__ import annotations

import torch
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup


def _warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return int(round(warmup_ratio * total_steps))


def cosine_with_warmup(
    optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over warmup_ratio of the steps, then cosine to 0 at total_steps (the paper)."""
    return get_cosine_schedule_with_warmup(optimizer, _warmup_steps(total_steps, warmup_ratio), total_steps)


def constant_with_warmup(
    optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup, then the optimizer's LR for the rest of the run."""
    return get_constant_schedule_with_warmup(optimizer, _warmup_steps(total_steps, warmup_ratio))
