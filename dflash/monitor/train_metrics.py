"""`train/` and `drafter{i}/` metrics from the replicas' metric windows (host floats only)."""

from __future__ import annotations

import itertools

from dflash.step.loss import objective_figures
from dflash.step.metrics import MetricWindow


class NonFiniteTraining(ValueError):
    """A step's loss or gradient was NaN or inf (its update was skipped on the device)."""


def longest_run(buckets: list[int]) -> int:
    return max((len(list(group)) for _, group in itertools.groupby(buckets)), default=0)


def train_metrics(groups: list[list[MetricWindow]]) -> dict[str, float]:
    """Merge windows (several log windows, each with one window per replica).

    Reduced as docs/ARCHITECTURE.md §1 says: sums of weighted-CE numerators and of weights, divided once, so a
    replica or a window with few supervised positions weighs what it holds and no more.
    """
    first = groups[0][0]
    block, num_buckets = first.block_size, first.num_buckets
    total = {
        "weighted_ce": 0.0,
        "weight": 0.0,
        "grad_norm": 0.0,
        "accepted": 0.0,
        "blocks": 0.0,
        "rounds": 0.0,
    }
    correct, counted = [0.0] * block, [0.0] * block
    bucket_ce, bucket_w = [0.0] * num_buckets, [0.0] * num_buckets
    per_replica: dict[int, dict[str, float]] = {}
    steps = run_max = 0
    nonfinite = 0.0
    for group in groups:
        # Every replica skips the same steps (they share the summed gradient): count them once.
        nonfinite += max(window.sums()["nonfinite_steps"] for window in group)
        for replica, window in enumerate(group):
            sums = window.sums()
            for key in total:
                total[key] += sums[key]
            correct = [a + b for a, b in zip(correct, sums["correct"])]
            counted = [a + b for a, b in zip(counted, sums["counted"])]
            bucket_ce = [a + b for a, b in zip(bucket_ce, sums["bucket_weighted_ce"])]
            bucket_w = [a + b for a, b in zip(bucket_w, sums["bucket_weight"])]
            mine = per_replica.setdefault(replica, {"weighted_ce": 0.0, "weight": 0.0})
            mine["weighted_ce"] += sums["weighted_ce"]
            mine["weight"] += sums["weight"]
            mine["lr"], mine["opt_step"] = window.lr, float(window.end_step)
            run_max = max(run_max, longest_run(window.buckets))
            steps += window.steps if replica == 0 else 0
    last = groups[-1][0]
    figures = objective_figures({**total, "correct": correct, "counted": counted})
    metrics = {
        **{f"train/{name}": value for name, value in figures.items()},
        "train/grad_norm": total["grad_norm"] / max(1, steps * len(groups[0])),
        "train/lr": last.lr,
        "train/opt_step": float(last.end_step),
        # How many optimizer steps the row's figures cover (logger.every_steps, more for a run's
        # last window: docs/observability.md "Windows").
        "train/window_steps": float(steps),
        "batch/same_bucket_run_max": float(run_max),
        "train/nonfinite_steps": nonfinite,
    }
    for bucket in range(num_buckets):
        if bucket_w[bucket] > 0:  # a bucket not seen in this tick has no loss, not a zero loss
            metrics[f"train/loss_bucket_{bucket}"] = bucket_ce[bucket] / bucket_w[bucket]
    for replica, mine in per_replica.items():
        metrics[f"drafter{replica}/loss"] = (
            mine["weighted_ce"] / mine["weight"] if mine["weight"] > 0 else 0.0
        )
        metrics[f"drafter{replica}/lr"] = mine["lr"]
        metrics[f"drafter{replica}/opt_step"] = mine["opt_step"]
    return metrics
