"""Training callbacks: user objects named in the `callbacks:` config node, told what a run does.

    dflash train +callbacks.mine._target_=my_module.MyCallback +callbacks.mine.path=/tmp/x

Each node of `callbacks` is built with `hydra.utils.instantiate` (its other keys are the
constructor's keyword arguments). A callback defines any subset of these hooks:

- `on_train_start(trainer)`: before the first step (rank 0), with the built trainer;
- `on_log(step, metrics)`: every row metrics.jsonl gets (`train/loss`, `perf/...`, `eval/...`),
  on the monitor's thread: the values are already on the host, so a hook adds no device sync;
- `on_checkpoint(step, path)`: after a checkpoint is written and `last` points at it, on the
  thread that wrote it;
- `on_eval(step, results)`: the final evaluation's metrics (periodic evaluations reach `on_log`
  as `eval/...` rows);
- `on_train_end(summary)`: the summary of a run that completed (what summary.json holds).

A hook that raises fails the run with its traceback, as any error does: a callback that pushes a
checkpoint somewhere must not lose it silently. docs/extending.md has worked examples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HOOKS = ("on_train_start", "on_log", "on_checkpoint", "on_eval", "on_train_end")


class TrainingCallbacks:
    """The run's callbacks, each called for the hooks it defines, in config order."""

    def __init__(self, callbacks: dict[str, Any] | None = None):
        self.callbacks = dict(callbacks or {})

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def _call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks.values():
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

    def on_train_start(self, trainer: Any) -> None:
        self._call("on_train_start", trainer)

    def on_checkpoint(self, step: int, path: Path) -> None:
        self._call("on_checkpoint", step, path)

    def on_eval(self, step: int, results: dict[str, float]) -> None:
        self._call("on_eval", step, dict(results))

    def on_train_end(self, summary: dict[str, Any]) -> None:
        self._call("on_train_end", dict(summary))

    # The metric-sink side (dflash/monitor/sinks/): the monitor hands it every logged row.
    def log(self, metrics: dict[str, float], step: int) -> None:
        self._call("on_log", step, dict(metrics))

    def close(self, ok: bool) -> None:
        pass


def build_callbacks(node: Any) -> TrainingCallbacks:
    """`callbacks` (a mapping name -> node with `_target_`) instantiated; a node without a
    `_target_`, or one whose class cannot be built, is refused naming `callbacks.NAME`."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    built = {}
    for name, spec in (node or {}).items():
        if not hasattr(spec, "get") or not spec.get("_target_"):
            raise ValueError(f"callbacks.{name} needs a _target_ (the class to build), e.g. +callbacks.{name}._target_=my_module.MyCallback")  # fmt: skip
        try:
            built[name] = instantiate(spec)
        except InstantiationException as exc:
            raise ValueError(f"callbacks.{name}: cannot build {spec.get('_target_')} ({exc})") from exc
        hooks = [hook for hook in HOOKS if callable(getattr(built[name], hook, None))]
        if not hooks:
            raise ValueError(
                f"callbacks.{name}: {spec.get('_target_')} defines none of the hooks {list(HOOKS)}"
            )
    return TrainingCallbacks(built)
