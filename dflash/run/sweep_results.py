"""A search's results file, written after every trial: each trial's parameters, outcome and
objective value, and the best so far, so a search that stops early (a failure limit, a signal,
every trial failing) still says what it found.

The Optuna sweeper writes `optimization_results.yaml` (best_params, best_value) only when the
whole search succeeds; this file has the same keys plus `trials` and `failed`, and is rewritten
with the sweeper's own best at the end.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

RESULTS_FILE = "optimization_results.yaml"


class SweepResults:
    def __init__(self, sweep_dir: Path, *, params: list[str], direction: str):
        self.path = Path(sweep_dir) / RESULTS_FILE
        self.params = params
        self.maximize = direction == "maximize"
        self.trials: list[dict[str, Any]] = []

    @property
    def failed(self) -> int:
        return sum(trial["status"] != "COMPLETED" for trial in self.trials)

    def add(self, *, number: int, overrides: list[str], status: str, value: Any, error: str | None) -> None:
        pairs = dict(o.split("=", 1) for o in overrides if "=" in o)
        self.trials.append(
            {
                "number": number,
                "params": {key: yaml.safe_load(pairs[key]) for key in self.params if key in pairs},
                "status": status,
                "value": value,
                "error": error,
            }
        )
        self.write()

    def best(self) -> dict[str, Any] | None:
        scored = [
            t
            for t in self.trials
            if t["status"] == "COMPLETED"
            and isinstance(t["value"], float)
            and not math.isnan(t["value"])  # fmt: skip
        ]
        if not scored:
            return None
        return (max if self.maximize else min)(scored, key=lambda t: t["value"])

    def write(self, sweeper_result: dict[str, Any] | None = None) -> None:
        best = self.best()
        results = {
            "name": "optuna",
            "best_params": best["params"] if best else None,
            "best_value": best["value"] if best else None,
            **(sweeper_result or {}),
            "failed": self.failed,
            "trials": self.trials,
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(yaml.safe_dump(results, sort_keys=False))
        tmp.replace(self.path)
