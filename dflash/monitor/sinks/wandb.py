"""logger.sinks.wandb: a W&B run, on its own thread."""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path

from dflash.monitor.sinks.background import background_factory
from dflash.monitor.sinks.base import SinkContext, SinkDestination, refuse_unwritable_dir, sweep_naming

log = logging.getLogger(__name__)

# The sink's config key, in its messages (the checks before loading name the entry's own key).
SINK_KEY = "logger.sinks.wandb"
# How long the check waits for the W&B server to answer (logger.sinks.wandb.connect_timeout_s);
# left to W&B, a server that does not answer costs its init_timeout (90 s) after the weights load.
CONNECT_TIMEOUT_S = 10.0


def wandb_mode(mode: str | None) -> str:
    """Explicit config wins, then WANDB_MODE; without an API key there is no network use: offline."""

    if mode:
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def wandb_server() -> str:
    """The server an online run talks to, as W&B resolves it: WANDB_BASE_URL, else the host
    `wandb login --host` saved in W&B's settings file, else W&B's default."""
    from wandb.sdk.wandb_settings import Settings

    settings = Settings()
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    return settings.base_url


def http_failure(url: str, timeout_s: float) -> str | None:
    """Why `url` gives no HTTP answer within `timeout_s` (None: it answered, any status)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None  # an answer: the server is there
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return f"does not answer within {timeout_s:g} s"
        return f"does not answer ({getattr(exc.reason, 'strerror', None) or exc.reason})"
    except TimeoutError:
        return f"does not answer within {timeout_s:g} s"
    except OSError as exc:
        return f"does not answer ({exc.strerror or exc})"


def check_wandb_destination(destination: SinkDestination) -> None:
    """logger.sinks.NAME of a W&B sink, before any weights load: the run's W&B directory takes
    files (offline and online), and online, the server answers."""
    key, settings = destination.key, destination.settings
    refuse_unwritable_dir(destination.run_dir / "wandb", key)
    check_wandb_server(
        key=key, mode=wandb_mode(settings["mode"]), connect_timeout_s=settings["connect_timeout_s"]
    )


def check_wandb_server(*, key: str, mode: str, connect_timeout_s: float) -> None:
    if mode != "online":
        return
    url = wandb_server()
    reason = http_failure(url, connect_timeout_s)
    if reason is not None:
        raise ValueError(
            f"{key} (mode=online): the W&B server {url} {reason}; set WANDB_BASE_URL to one that "
            f"answers, or {key}.mode=offline (`wandb sync` uploads the run later)"
        )


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
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ):
        import wandb

        self.timeout_s = finish_timeout_s
        self.log_checkpoints = log_checkpoints
        sweep_group, job_name = sweep_naming()
        resumed = resumed_wandb_run(context.resume_dir)
        mode = wandb_mode(mode)
        # Checked before any weights load too; again here, as the server may have gone since.
        check_wandb_server(key=SINK_KEY, mode=mode, connect_timeout_s=connect_timeout_s)
        try:
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
                mode=mode,
                reinit="finish_previous",
            )
        except (wandb.errors.Error, OSError) as exc:  # no key, a server that refuses, a dir
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{SINK_KEY} (mode={mode}): W&B could not start the run ({reason})") from exc

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


# logger.sinks.wandb (conf/logger/wandb.yaml): WandbSink's settings, plus `queue_size`.
wandb_sink = background_factory("wandb", WandbSink)
