"""Metric sinks (config group `logger`, `logger.sinks`): metrics.jsonl, console lines, W&B,
TensorBoard event files, MLflow.

A sink receives one flat dict of floats per log step. `close(ok)` always runs, also when the job
fails, so a W&B or MLflow run is always finished (marked failed when the job failed). Optional
hooks: `on_checkpoint(step, path)` after each checkpoint, `log_summary(summary)` with the run
summary (what summary.json holds) of a run that got that far.

Each entry of `logger.sinks` names a class or factory (`_target_`) built with the run's
`context=` (SinkContext) and the entry's other keys; a user's sink is one class with `log` and
`close` (docs/extending.md): +logger.sinks.mine._target_=my_module.MySink.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
import re
import threading
import time
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


@dataclass(frozen=True)
class OptionalLibrary:
    """The library a sink needs that dflash does not install by default: its module, the dflash
    extra that installs it and the logger option that uses it. Checked before any weights load
    (dflash/run/preflight.py), imported when the sink is built."""

    module: str
    extra: str
    option: str

    def missing(self, key: str) -> str:
        return f"{key} (logger={self.option}) needs the {self.module} package: pip install 'dflash[{self.extra}]'"

    def check(self, key: str) -> None:
        if importlib.util.find_spec(self.module) is None:
            raise ValueError(self.missing(key))

    def load(self, key: str, module: str | None = None) -> Any:
        try:
            return importlib.import_module(module or self.module)
        except ImportError as exc:
            raise ValueError(self.missing(key)) from exc


TENSORBOARD = OptionalLibrary(module="tensorboard", extra="tensorboard", option="tensorboard")
MLFLOW = OptionalLibrary(module="mlflow", extra="mlflow", option="mlflow")


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

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The wrapped sink's summary hook, where it has one (on the caller's thread)."""
        hook = getattr(self.sink, "log_summary", None)
        if hook is not None:
            hook(summary)

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
        # torch's writer needs the tensorboard package
        SummaryWriter = TENSORBOARD.load("logger.sinks.tensorboard", "torch.utils.tensorboard").SummaryWriter
        self.log_dir = context.run_dir / subdir
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)

    def close(self, ok: bool) -> None:
        self.writer.flush()
        self.writer.close()


# Kept in every checkpoint: the MLflow run a `resume=` of that checkpoint continues, and its store.
MLFLOW_RUN_FILE = "mlflow_run.json"
# MLflow's limits (mlflow.utils.validation): a param value of at most 6000 characters, a tag value
# of at most 8000; names of letters, digits and `_ - . / space` (a colon too, except on Windows).
MLFLOW_PARAM_CHARS = 6000
MLFLOW_TAG_CHARS = 8000
_MLFLOW_UNNAMEABLE = re.compile(r"[^\w./\- ]")


def mlflow_name(key: str) -> str:
    """A metric, param or tag name MLflow accepts (any other character becomes `_`)."""
    return _MLFLOW_UNNAMEABLE.sub("_", key)


def mlflow_value(value: Any, limit: int) -> str:
    """A param or tag value: strings as they are, anything else as JSON, cut to MLflow's limit
    (the artifact config_resolved.yaml holds the whole config)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) <= limit:
        return text
    note = " ... (cut; config_resolved.yaml holds it whole)"
    return text[: limit - len(note)] + note


def config_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as MLflow params: one per leaf, named by its dotted key (an empty
    mapping is a leaf, `{}`), lists as JSON."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(config_params(value, f"{name}."))
        else:
            params[mlflow_name(name)] = mlflow_value(value, MLFLOW_PARAM_CHARS)
    return params


def default_mlflow_store(run_dir: Path) -> str:
    """A SQLite file in the run dir. MLflow 3 refuses its file store (`<dir>/mlruns`) unless
    MLFLOW_ALLOW_FILE_STORE=true is set (it is in maintenance mode, kept for old data): SQLite
    is MLflow's own local backend, on the standard library's sqlite3 (the `mlflow` extra brings
    the SQLAlchemy and alembic it drives it with)."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def mlflow_artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: `mlartifacts` beside the
    database (MLflow's own default, `./mlruns`, depends on the working directory). None for
    other stores: a tracking server has its own artifact store."""
    if not tracking_uri.startswith("sqlite:///") or tracking_uri.endswith(":memory:"):
        return None
    database = Path(tracking_uri[len("sqlite:///") :])
    return (database.resolve().parent / "mlartifacts").as_uri()


def is_local_mlflow_store(tracking_uri: str) -> bool:
    """A SQLite file or a directory (a bare word such as `databricks` names a service)."""
    return tracking_uri.startswith(("sqlite:", "file:", "/", "."))


def hydra_choice(group: str) -> str | None:
    """The option of a config group this run was composed with (None outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def resumed_mlflow_run(resume_dir: Path | None) -> dict[str, str] | None:
    """The MLflow run a resumed checkpoint keeps (`run_id`, `tracking_uri`; None: a fresh run, or
    a checkpoint written without MLflow)."""
    if resume_dir is None or not (Path(resume_dir) / MLFLOW_RUN_FILE).is_file():
        return None
    try:
        record = json.loads((Path(resume_dir) / MLFLOW_RUN_FILE).read_text())
        return {"run_id": str(record["run_id"]), "tracking_uri": str(record["tracking_uri"])}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"resume={resume_dir}: {MLFLOW_RUN_FILE} names no MLflow run ({exc})") from exc


class MlflowSink:
    """logger=mlflow: an MLflow run (needs the `mlflow` extra). Its params are the resolved config
    (one per leaf; the whole of it also as the artifact config_resolved.yaml), its metrics every
    row at its step, and the run summary as `summary/...` metrics (numbers) and tags (the rest);
    it ends FINISHED, or FAILED when the job failed.

    The store: `tracking_uri`, else the one a resumed checkpoint names, else MLFLOW_TRACKING_URI,
    else a SQLite file in the run dir (default_mlflow_store). The experiment: `experiment`, else
    MLFLOW_EXPERIMENT_NAME, else the `experiment=` option the run was composed with, else
    `dflash`. Each checkpoint keeps the run's id and store (mlflow_run.json), so `resume=` of it
    continues the same MLflow run, in that store; params a resumed run sets anew are kept as
    first logged (MLflow never changes a param), its config is the artifact
    resume_step_N/config_resolved.yaml."""

    def __init__(
        self,
        *,
        context: SinkContext,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: dict[str, Any] | None = None,
        finish_timeout_s: float = 30.0,
    ):
        resumed = resumed_mlflow_run(context.resume_dir)
        self.tracking_uri = (
            tracking_uri
            or (resumed or {}).get("tracking_uri")
            or os.environ.get("MLFLOW_TRACKING_URI")
            or default_mlflow_store(context.run_dir)
        )
        if is_local_mlflow_store(self.tracking_uri):
            # MLflow sends usage events to its own servers unless told not to (read when mlflow
            # is imported); a local store is chosen to keep a run on this machine.
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        MLFLOW.load("logger.sinks.mlflow")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._param, self._tag = Metric, Param, RunTag
        self.timeout_s = finish_timeout_s
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self._summary: dict[str, Any] | None = None
        if resumed is not None:
            self.run_id = resumed["run_id"]
            self._continue(context)
        else:
            self.run_id = self._start(context, experiment=experiment, run_name=run_name, tags=tags or {})

    def _start(
        self, context: SinkContext, *, experiment: str | None, run_name: str | None, tags: dict
    ) -> str:
        name = (
            experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or hydra_choice("experiment") or "dflash"
        )
        experiment_id = self._experiment_id(name)
        sweep_group, job_name = sweep_naming()
        run_tags = {
            "dflash.run_dir": str(context.run_dir.resolve()),
            **({"dflash.sweep": sweep_group} if sweep_group else {}),  # runs of one sweep
            **{mlflow_name(str(k)): mlflow_value(v, MLFLOW_TAG_CHARS) for k, v in tags.items()},
        }
        run = self.client.create_run(
            experiment_id,
            # A sweep's job is named by the overrides that differ; a single run by its run dir
            # (outputs/DATE/TIME: the last two parts).
            run_name=run_name or job_name or "/".join(context.run_dir.parts[-2:]),
            tags=run_tags,
        )
        params = [self._param(k, v) for k, v in config_params(context.config).items()]
        self.client.log_batch(run.info.run_id, params=params)
        self.client.log_dict(run.info.run_id, context.config, "config_resolved.yaml")
        return run.info.run_id

    def _experiment_id(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(
                name, artifact_location=mlflow_artifact_location(self.tracking_uri)
            )
        except Exception:  # another job of a sweep sharing the store created it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _continue(self, context: SinkContext) -> None:
        try:
            run = self.client.get_run(self.run_id)
        except Exception as exc:  # MLflow's "run not found", or a store that is not there
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ValueError(
                f"resume={context.resume_dir}: {MLFLOW_RUN_FILE} names MLflow run {self.run_id}, which "
                f"{self.tracking_uri} does not hold ({reason}); logger.sinks.mlflow.tracking_uri names "
                "the store that does"
            ) from exc
        self.client.update_run(self.run_id, status="RUNNING")
        known = run.data.params
        params = [self._param(k, v) for k, v in config_params(context.config).items() if k not in known]
        resumed_from = f"{context.resume_dir} (step {context.start_step})"
        self.client.log_batch(
            self.run_id, params=params, tags=[self._tag("dflash.resumed_from", resumed_from)]
        )
        self.client.log_dict(
            self.run_id, context.config, f"resume_step_{context.start_step}/config_resolved.yaml"
        )

    def on_checkpoint(self, step: int, path: Path) -> None:
        record = {"run_id": self.run_id, "tracking_uri": self.tracking_uri}
        (Path(path) / MLFLOW_RUN_FILE).write_text(json.dumps(record) + "\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # NaN/inf are left out, as metrics.jsonl writes them as null. Evaluation rows arrive at
        # their snapshot's step, after rows of later steps: MLflow keeps each metric by step.
        now_ms = int(time.time() * 1000)
        batch = [
            self._metric(mlflow_name(key), float(value), now_ms, step)
            for key, value in metrics.items()
            if math.isfinite(value)
        ]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Kept for close(): logged after every queued row (this runs beside the sink's thread)."""
        self._summary = dict(summary)

    def _finish(self, ok: bool) -> None:
        try:
            if self._summary is not None:
                step = int(self._summary.get("steps", 0))
                now_ms = int(time.time() * 1000)
                metrics, tags = [], []
                for key, value in self._summary.items():
                    name = mlflow_name(f"summary/{key}")
                    number = isinstance(value, (int, float)) and not isinstance(value, bool)
                    if number and math.isfinite(value):
                        metrics.append(self._metric(name, float(value), now_ms, step))
                    elif not number:
                        tags.append(self._tag(name, mlflow_value(value, MLFLOW_TAG_CHARS)))
                self.client.log_batch(self.run_id, metrics=metrics, tags=tags)
            self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")
        except Exception as exc:  # the job's own outcome stands; the tracker only reports it
            log.warning("mlflow: could not finish run %s (%s)", self.run_id, exc)

    def close(self, ok: bool) -> None:
        # A tracking server that stalls must not hang the job forever.
        finisher = threading.Thread(target=self._finish, args=(ok,), daemon=True)
        finisher.start()
        finisher.join(self.timeout_s)
        if finisher.is_alive():
            log.warning("mlflow: the run did not finish within %.0f s; continuing", self.timeout_s)


def mlflow_sink(
    *,
    context: SinkContext,
    tracking_uri: str | None = None,
    experiment: str | None = None,
    run_name: str | None = None,
    tags: dict[str, Any] | None = None,
    queue_size: int = 100,
    finish_timeout_s: float = 30.0,
):
    """logger.sinks.mlflow: an MlflowSink on its own thread (BackgroundSink), `queue_size` ticks
    deep (the oldest dropped, and counted, when the store stalls), given `finish_timeout_s` to
    finish the run."""
    sink = MlflowSink(
        context=context,
        tracking_uri=tracking_uri,
        experiment=experiment,
        run_name=run_name,
        tags=tags,
        finish_timeout_s=finish_timeout_s,
    )
    return BackgroundSink("mlflow", sink, queue_size=queue_size, close_timeout_s=finish_timeout_s)


# The optional library of each sink that needs one: checked before any weights load.
SINK_LIBRARIES: dict[Any, OptionalLibrary] = {
    TensorBoardSink: TENSORBOARD,
    MlflowSink: MLFLOW,
    mlflow_sink: MLFLOW,
}


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
