"""`train/` and `drafter{i}/` metrics from the replicas' metric windows (host floats only)."""

from __future__ import annotations

import itertools

from dflash.step.loss import objective_figures
from dflash.step.metrics import MetricWindow, metric_fields


class NonFiniteTraining(ValueError):
    """A step's loss or gradient was NaN or inf (its update was skipped on the device)."""


def longest_run(buckets: list[int]) -> int:
    return max((len(list(group)) for _, group in itertools.groupby(buckets)), default=0)


def train_metrics(groups: list[list[MetricWindow]]) -> dict[str, float]:
    """Merge windows (several log windows, each with one window per replica).

    Reduced as docs/ARCHITECTURE.md §1 says: sums of weighted-CE numerators and of weights, divided once, so a
    replica or a window with few supervised positions weighs what it holds and no more.
    """
    variant = groups[0][0].variant  # a variant adds its own sums and figures (step/variant.py)
    fields = metric_fields(variant)
    total: dict[str, float | list[float]] = {}
    per_replica: dict[int, dict[str, float]] = {}
    steps = run_max = 0
    for group in groups:
        for replica, window in enumerate(group):
            sums = window.sums()
            for field in fields:
                if field.name == "nonfinite_steps":
                    continue  # counted once per group below
                value = sums[field.name]
                if field.name not in total:
                    total[field.name] = 0.0 if field.width == "one" else [0.0] * len(value)
                if field.width == "one":
                    total[field.name] += value
                else:
                    total[field.name] = [a + b for a, b in zip(total[field.name], value)]
            mine = per_replica.setdefault(replica, {"weighted_ce": 0.0, "weight": 0.0})
            mine["weighted_ce"] += sums["weighted_ce"]
            mine["weight"] += sums["weight"]
            mine["lr"], mine["opt_step"] = window.lr, float(window.end_step)
            run_max = max(run_max, longest_run(window.buckets))
            steps += window.steps if replica == 0 else 0
    # Every replica skips the same steps (they share the summed gradient): count them once.
    nonfinite = sum(max(window.sums()["nonfinite_steps"] for window in group) for group in groups)
    last = groups[-1][0]
    figures = objective_figures(total, variant)
    metrics = {f"train/{name}": value for name, value in figures.items()}
    replica_steps = max(1, steps * len(groups[0]))
    for field in fields:
        if field.per == "step":
            metrics[f"train/{field.name}"] = total[field.name] / replica_steps
        elif field.per is not None:
            denominator = total[field.per]
            metrics[f"train/{field.name}"] = total[field.name] / denominator if denominator > 0 else 0.0
    metrics |= {
        "train/lr": last.lr,
        "train/opt_step": float(last.end_step),
        # How many optimizer steps the row's figures cover (logger.every_steps, more for a run's
        # last window: docs/observability.md "Windows").
        "train/window_steps": float(steps),
        "batch/same_bucket_run_max": float(run_max),
        "train/nonfinite_steps": nonfinite,
    }
    bucket_ce, bucket_w = total["bucket_weighted_ce"], total["bucket_weight"]
    for bucket in range(len(bucket_w)):
        if bucket_w[bucket] > 0:  # a bucket not seen in this tick has no loss, not a zero loss
            metrics[f"train/loss_bucket_{bucket}"] = bucket_ce[bucket] / bucket_w[bucket]
    for replica, mine in per_replica.items():
        metrics[f"drafter{replica}/loss"] = (
            mine["weighted_ce"] / mine["weight"] if mine["weight"] > 0 else 0.0
        )
        metrics[f"drafter{replica}/lr"] = mine["lr"]
        metrics[f"drafter{replica}/opt_step"] = mine["opt_step"]
    return metrics
