"""logger.sinks.mlflow: an MLflow run, on its own thread."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from dflash.monitor.sinks.background import background_factory
from dflash.monitor.sinks.base import SinkContext, hydra_choice, sweep_naming
from dflash.monitor.sinks.mlflow_store import (
    CONNECT_TIMEOUT_S,
    MLFLOW_RUN_FILE,
    check_store,
    import_mlflow,
    resumed_mlflow_run,
    tracking_store,
)

log = logging.getLogger(__name__)

# The sink's config key, in its messages (the checks before loading name the entry's own key).
SINK_KEY = "logger.sinks.mlflow"
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


def mlflow_artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: `mlartifacts` beside the
    database (MLflow's own default, `./mlruns`, depends on the working directory). None for
    other stores: a tracking server has its own artifact store."""
    if not tracking_uri.startswith("sqlite:///") or tracking_uri.endswith(":memory:"):
        return None
    database = Path(tracking_uri[len("sqlite:///") :])
    return (database.resolve().parent / "mlartifacts").as_uri()


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
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ):
        resumed = resumed_mlflow_run(context.resume_dir)
        store = tracking_store(
            key=SINK_KEY,
            tracking_uri=tracking_uri,
            resumed=resumed,
            resume_dir=context.resume_dir,
            run_dir=context.run_dir,
        )
        MlflowClient = import_mlflow(store, SINK_KEY)
        # Checked before any weights load too; again here, as the store may have gone since.
        check_store(store, key=SINK_KEY, connect_timeout_s=connect_timeout_s)
        self.tracking_uri = store.uri
        from mlflow.entities import Metric, Param, RunTag

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


# logger.sinks.mlflow (conf/logger/mlflow.yaml): MlflowSink's settings, plus `queue_size`.
mlflow_sink = background_factory("mlflow", MlflowSink)
