"""Turns replicas' metric windows into one flat dict of floats per log step for the sinks."""

from __future__ import annotations

from dflash.logging.sinks import MetricSink
from dflash.loss import tau_from_accuracy
from dflash.trainer.step import MetricWindow


def window_metrics(windows: list[MetricWindow], elapsed_s: float, lr: float) -> dict[str, float]:
    """Replicas are reduced the DESIGN way: sums of numerators and of weights, divided once."""
    block = windows[0].block_size
    weighted_ce = weight = grad_norm = 0.0
    correct, counted = [0.0] * block, [0.0] * block
    per_drafter = {}
    for index, window in enumerate(windows):
        w_ce, w, gn, c, n = window.sums()
        weighted_ce, weight, grad_norm = weighted_ce + w_ce, weight + w, grad_norm + gn
        correct = [a + b for a, b in zip(correct, c)]
        counted = [a + b for a, b in zip(counted, n)]
        if len(windows) > 1:
            per_drafter[f"drafter{index}/loss"] = w_ce / w if w > 0 else 0.0
            per_drafter[f"drafter{index}/opt_step"] = float(window.end_step)
    acc = [c / n if n > 0 else float("nan") for c, n in zip(correct, counted)]
    steps = sum(w.steps for w in windows)
    elapsed_s = max(elapsed_s, 1e-9)
    metrics = {
        "train/loss": weighted_ce / weight if weight > 0 else 0.0,
        "train/acc": sum(correct[1:]) / max(1.0, sum(counted[1:])),
        "train/tau_sim": tau_from_accuracy(acc),
        "train/grad_norm": grad_norm / max(1, steps),
        "train/lr": lr,
        "perf/tokens_per_s": sum(w.real_tokens for w in windows) / elapsed_s,
        "perf/samples_per_s": sum(w.samples for w in windows) / elapsed_s,
        "perf/anchors_per_s": sum(w.anchors for w in windows) / elapsed_s,
        "perf/step_time_s": elapsed_s / max(1, windows[0].steps),
    }
    metrics.update({f"train/acc_pos_{k}": acc[k] for k in range(1, block)})
    metrics.update(per_drafter)
    return metrics


class MetricsLog:
    """Fans each window out to every sink and keeps the history for the run summary."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks
        self.history: list[dict[str, float]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_window(
        self,
        step: int,
        windows: list[MetricWindow],
        elapsed_s: float,
        lr: float,
        extra: dict[str, float] | None = None,
    ) -> None:
        metrics = window_metrics(windows, elapsed_s, lr) | (extra or {})
        self.history.append({"step": float(step), **metrics})
        self.log(metrics, step)

    def close(self, ok: bool) -> None:
        for sink in self.sinks:
            sink.close(ok)
