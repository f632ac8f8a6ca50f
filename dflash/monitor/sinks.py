"""Metric sinks (config group `logger`, `logger.sinks`): metrics.jsonl, console lines, W&B,
TensorBoard event files.

A sink receives one flat dict of floats per log step. `close(ok)` always runs, also when the job
fails, so a W&B run is always finished (with a failing exit code when the job failed).

Each entry of `logger.sinks` names a class or factory (`_target_`) built with the run's
`context=` (SinkContext) and the entry's other keys; a user's sink is one class with `log` and
`close` (docs/extending.md): +logger.sinks.mine._target_=my_module.MySink.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dflash.config.components import build, check_buildable
from dflash.step.metrics import metric_fields

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, ok: bool) -> None: ...


@dataclass(frozen=True)
class SinkContext:
    """What every sink is built with: the run dir, the resolved config (a dict), the run's step
    count and the step a resumed run starts from."""

    run_dir: Path
    config: dict[str, Any]
    total_steps: int
    start_step: int = 0
    resume_dir: Path | None = None  # the checkpoint a resumed run continues (resume=)


class JsonlSink:
    """<run_dir>/metrics.jsonl: one JSON object per log step, flushed so readers see it at once."""

    def __init__(self, *, context: SinkContext):
        path = context.run_dir / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # NaN/inf are not JSON: written as null so every line stays parseable by later tools.
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self, ok: bool) -> None:
        self._file.close()


class ProgressSink:
    """A progress bar for the whole run (tqdm, on stderr, only when it is a terminal), starting at
    the step a resumed run continues from."""

    def __init__(self, *, context: SinkContext):
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (CI logs, redirected output).
        self.bar = tqdm(
            total=context.total_steps,
            initial=context.start_step,
            unit="step",
            dynamic_ncols=True,
            leave=True,
            disable=None,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.bar.update(max(0, step - self.bar.n))

    def close(self, ok: bool) -> None:
        self.bar.close()


class ConsoleSink(ProgressSink):
    """The progress bar plus one readable line per log window, printed above the bar (tqdm.write:
    lines never tear it)."""

    FIGURES = ("train/loss", "train/acc", "train/tau_sim", "train/tau_decode")
    # DSpark's figures (absent from a DFlash run's rows, so not printed there).
    DSPARK = ("train/tau_prob", "train/l1", "train/confidence_abs_error")
    AFTER = ("train/lr", "perf/tokens_per_s", "perf/data_wait_frac", "queue/hs_fill", "gpu/drafter/util_pct")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The line's keys: the objective's figures, each metric field marked `console`, the rest."""
        fields = tuple(f"train/{field.name}" for field in metric_fields() if field.console)
        return cls.FIGURES + cls.DSPARK + fields + cls.AFTER

    def log(self, metrics: dict[str, float], step: int) -> None:
        if "train/loss" not in metrics:
            return  # telemetry-only rows, and evaluation rows (printed in the run summary)
        super().log(metrics, step)
        parts = [f"{k.split('/', 1)[-1]}={metrics[k]:.4g}" for k in self.keys() if k in metrics]
        self.bar.write(f"step {step:>6}  " + "  ".join(parts))


class BackgroundSink:
    """Runs a slow sink (W&B) on its own thread behind a bounded queue that drops the oldest tick.

    The monitor only enqueues, so a stalled network can never hold up training; dropped ticks are
    counted and reported as `monitor/<name>_dropped` in later ticks.
    """

    def __init__(self, name: str, sink: MetricSink, *, queue_size: int, close_timeout_s: float):
        self.name, self.sink = name, sink
        self.close_timeout_s = close_timeout_s
        self._items: deque = deque()
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"dflash-sink-{name}", daemon=True)
        self._thread.start()

    def health(self) -> dict[str, float]:
        return {f"monitor/{self.name}_dropped": float(self.dropped)}

    def on_checkpoint(self, step: int, path: Path) -> None:
        """The wrapped sink's checkpoint hook, where it has one (on the checkpoint's thread)."""
        hook = getattr(self.sink, "on_checkpoint", None)
        if hook is not None:
            hook(step, path)

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self._cond:
            if len(self._items) >= self._queue_size:
                self._items.popleft()
                self.dropped += 1
            self._items.append((dict(metrics), step))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                metrics, step = self._items.popleft()
            try:
                self.sink.log(metrics, step)
            except Exception as exc:  # a sink failure must not take the run down
                log.warning("%s sink: dropped a tick (%s)", self.name, exc)

    def close(self, ok: bool) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning(
                "%s sink: still busy after %.0f s; closing with ticks unsent", self.name, self.close_timeout_s
            )
        self.sink.close(ok)


def wandb_mode(mode: str | None) -> str:
    """Explicit config wins, then WANDB_MODE; without an API key there is no network use: offline."""

    if mode:
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def sweep_naming() -> tuple[str | None, str | None]:
    """(group, name) for a job of a Hydra multirun: the sweep dir and the job's own overrides."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None, None
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.sweep.dir).name, hydra_cfg.job.override_dirname or None


EVAL_STEP = "snapshot_step"
# Kept in every checkpoint: the W&B run a `resume=` of that checkpoint continues.
WANDB_RUN_FILE = "wandb_run.json"


class WandbSink:
    """A W&B run (logger=wandb: its keys are logger.sinks.wandb's; mode null: WANDB_MODE if set,
    else online with an API key and offline without one). Runs of one sweep share a group named
    after the sweep dir and are named by the overrides that differ. Each checkpoint keeps the
    run's id (wandb_run.json), so `resume=` of it continues the same W&B run; with
    `log_checkpoints`, each checkpoint is also logged as a `model` artifact of the run."""

    def __init__(
        self,
        *,
        context: SinkContext,
        project: str = "dflash",
        entity: str | None = None,
        mode: str | None = None,
        group: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
        finish_timeout_s: float = 30.0,
        log_checkpoints: bool = False,
    ):
        import wandb

        self.timeout_s = finish_timeout_s
        self.log_checkpoints = log_checkpoints
        sweep_group, job_name = sweep_naming()
        resumed = resumed_wandb_run(context.resume_dir)
        self.run = wandb.init(
            id=resumed,
            resume="allow" if resumed else None,
            project=project,
            entity=entity,
            group=group or sweep_group,  # runs of one sweep share a group
            name=name or job_name,  # ... and are named by the overrides that differ
            tags=list(tags or []),
            config=context.config,
            dir=str(context.run_dir),
            mode=wandb_mode(mode),
            reinit="finish_previous",
        )

        self._defined: set[str] = set()
        # An evaluation measures a snapshot of step N and finishes after rows of later steps were
        # logged; W&B ignores a row whose step is below its current one. Evaluation and held-out
        # figures therefore plot against their own axis, EVAL_STEP (the snapshot's step).
        self.run.define_metric(EVAL_STEP)
        for family in ("eval", "val"):
            self.run.define_metric(f"{family}/*", step_metric=EVAL_STEP)
        self._step = -1

    def on_checkpoint(self, step: int, path: Path) -> None:
        record = {"id": self.run.id, "project": self.run.project, "entity": self.run.entity}
        (Path(path) / WANDB_RUN_FILE).write_text(json.dumps(record) + "\n")
        if self.log_checkpoints:
            import wandb

            artifact = wandb.Artifact(f"drafter-{self.run.id}", type="model", metadata={"step": step})
            artifact.add_dir(str(path))
            self.run.log_artifact(artifact, aliases=[f"step-{step}", "latest"])

    def log(self, metrics: dict[str, float], step: int) -> None:
        # Each drafter gets its own x-axis (its optimizer step), so step skew between drafters shows.
        for key in metrics:
            prefix = key.split("/", 1)[0]
            if prefix.startswith("drafter") and prefix not in self._defined:
                self.run.define_metric(f"{prefix}/opt_step")
                self.run.define_metric(f"{prefix}/*", step_metric=f"{prefix}/opt_step")
                self._defined.add(prefix)
        if any(key.startswith(("eval/", "val/")) for key in metrics):
            metrics = {**metrics, EVAL_STEP: float(step)}
        if step < self._step:
            self.run.log(metrics)  # at W&B's current step; plotted at EVAL_STEP
            return
        self._step = step
        self.run.log(metrics, step=step)

    def close(self, ok: bool) -> None:
        # finish() uploads what is left; a stalled network must not hang the job forever.
        finisher = threading.Thread(target=self.run.finish, kwargs={"exit_code": 0 if ok else 1}, daemon=True)
        finisher.start()
        finisher.join(self.timeout_s)
        if finisher.is_alive():
            log.warning("wandb: finish() did not return within %.0f s; continuing", self.timeout_s)


def resumed_wandb_run(resume_dir: Path | None) -> str | None:
    """The W&B run id a resumed checkpoint keeps (None: a fresh run, or a checkpoint written
    without W&B)."""
    if resume_dir is None or not (Path(resume_dir) / WANDB_RUN_FILE).is_file():
        return None
    try:
        return json.loads((Path(resume_dir) / WANDB_RUN_FILE).read_text())["id"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"resume={resume_dir}: {WANDB_RUN_FILE} names no W&B run ({exc})") from exc


def wandb_sink(
    *, context: SinkContext, queue_size: int = 100, finish_timeout_s: float = 30.0, **settings: Any
):
    """logger.sinks.wandb: a WandbSink on its own thread (BackgroundSink), `queue_size` ticks deep
    (the oldest dropped, and counted, when W&B stalls), given `finish_timeout_s` to finish."""
    sink = WandbSink(context=context, finish_timeout_s=finish_timeout_s, **settings)
    return BackgroundSink("wandb", sink, queue_size=queue_size, close_timeout_s=finish_timeout_s)


class TensorBoardSink:
    """logger=tensorboard: every row as TensorBoard scalars, event files in <run_dir>/tensorboard
    (`tensorboard --logdir outputs` shows every run; needs the `tensorboard` extra). Evaluation
    rows arrive at their snapshot's step, after rows of later steps: TensorBoard plots by step
    whatever the order. NaN/inf are left out, as metrics.jsonl writes them as null."""

    def __init__(self, *, context: SinkContext, subdir: str = "tensorboard", flush_secs: float = 30.0):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's writer needs the tensorboard package
            raise ValueError(
                "logger=tensorboard needs the tensorboard package: pip install 'dflash[tensorboard]'"
            ) from exc
        self.log_dir = context.run_dir / subdir
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)

    def close(self, ok: bool) -> None:
        self.writer.flush()
        self.writer.close()


def build_sinks(nodes: dict[str, Any], context: SinkContext) -> list[MetricSink]:
    """`logger.sinks`, each built with `context` (a ConsoleSink draws the progress bar itself:
    a plain ProgressSink beside one is left out)."""
    classes = {
        name: check_buildable(node, f"logger.sinks.{name}", runtime=("context",))
        for name, node in nodes.items()
    }
    console = any(isinstance(c, type) and issubclass(c, ConsoleSink) for c in classes.values())
    return [
        build(node, f"logger.sinks.{name}", context=context)
        for name, node in nodes.items()
        if not (console and classes[name] is ProgressSink)
    ]
