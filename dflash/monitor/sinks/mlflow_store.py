"""The MLflow store a run logs to: which one (`tracking_uri`, a resumed checkpoint's, the
environment's, or a SQLite file in the run dir), and whether it answers and takes writes.

Left to MLflow, an unreachable tracking server costs its HTTP retries (7, backing off to 2 min:
254 s here) and a SQLite file it cannot open its engine retries (110 s), each before the run's
first step; checked here with one try and a short timeout, the run is refused in seconds, naming
the key, before any weights load (dflash/run/preflight.py) and again when the sink is built.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dflash.monitor.sinks.base import OptionalLibrary, SinkDestination, refuse_unwritable_dir

MLFLOW = OptionalLibrary(module="mlflow", extra="mlflow", option="mlflow")
# Kept in every checkpoint: the MLflow run a `resume=` of that checkpoint continues, and its store.
MLFLOW_RUN_FILE = "mlflow_run.json"
# How long the check waits for a store to answer (logger.sinks.mlflow.connect_timeout_s).
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TrackingStore:
    """A store's URI and who chose it (the message of a refusal names that)."""

    uri: str
    chosen_by: str  # `tracking_uri`, `resume=...`, MLFLOW_TRACKING_URI or "default"

    @property
    def is_default(self) -> bool:
        return self.chosen_by == "default"


def default_mlflow_store(run_dir: Path) -> str:
    """A SQLite file in the run dir. MLflow 3 refuses its file store (`<dir>/mlruns`) unless
    MLFLOW_ALLOW_FILE_STORE=true is set (it is in maintenance mode, kept for old data): SQLite
    is MLflow's own local backend, on the standard library's sqlite3 (the `mlflow` extra brings
    the SQLAlchemy and alembic it drives it with)."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def is_local_mlflow_store(tracking_uri: str) -> bool:
    """A SQLite file or a directory (a bare word such as `databricks` names a service)."""
    return tracking_uri.startswith(("sqlite:", "file:", "/", "."))


def tracking_store(
    *,
    key: str,
    tracking_uri: str | None,
    resumed: dict[str, str] | None,
    resume_dir: Path | None,
    run_dir: Path,
) -> TrackingStore:
    """`tracking_uri`, else the store a resumed checkpoint names, else MLFLOW_TRACKING_URI, else
    a SQLite file in the run dir (`key`: the sink's, logger.sinks.NAME)."""
    if tracking_uri:
        return TrackingStore(tracking_uri, f"{key}.tracking_uri={tracking_uri}")
    if resumed is not None:
        return TrackingStore(resumed["tracking_uri"], f"resume={resume_dir} ({MLFLOW_RUN_FILE})")
    if os.environ.get("MLFLOW_TRACKING_URI"):
        uri = os.environ["MLFLOW_TRACKING_URI"]
        return TrackingStore(uri, f"MLFLOW_TRACKING_URI={uri}")
    return TrackingStore(default_mlflow_store(run_dir), "default")


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


def import_mlflow(store: TrackingStore, key: str):
    """MLflow's client class, imported with its usage events off for a local store (MLflow sends
    them to its own servers unless told not to, read when mlflow is imported; a local store is
    chosen to keep a run on this machine)."""
    if is_local_mlflow_store(store.uri):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    MLFLOW.load(key)
    from mlflow.tracking import MlflowClient

    return MlflowClient


def check_store(store: TrackingStore, *, key: str, connect_timeout_s: float) -> None:
    """Refuse, in one line naming the key, a store that cannot take this run: a SQLite file or
    directory that cannot be written, a server (or database) that does not answer within
    `connect_timeout_s`. The default store, in the run dir, is written by the run itself."""
    if store.is_default:
        return
    MLFLOW.check(key)  # its SQLAlchemy opens a SQLite store
    if store.uri.startswith("sqlite:"):
        check_sqlite_store(store, key=key)
    elif is_local_mlflow_store(store.uri):
        refuse_unwritable_dir(Path(store.uri.removeprefix("file://").removeprefix("file:")), store.chosen_by)
    else:
        check_store_answers(store, key=key, connect_timeout_s=connect_timeout_s)


def refusal(store: TrackingStore, key: str, reason: str) -> ValueError:
    return ValueError(
        f"{store.chosen_by}: the MLflow store {reason}; set {key}.tracking_uri to a store this run can write"
    )


def check_sqlite_store(store: TrackingStore, *, key: str) -> None:
    """A SQLite store takes writes: an existing file is written to in a transaction that is rolled
    back; a new one needs a writable directory (MLflow creates the file and its parents)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    url = make_url(store.uri)
    database = (url.database or "").removeprefix("file:")
    if database in ("", ":memory:"):
        return
    if not Path(database).exists():
        if url.query.get("mode") == "ro":  # SQLite would not create it; MLflow retries for 110 s
            raise refusal(store, key, "does not exist, and is opened read-only (mode=ro)")
        refuse_unwritable_dir(Path(database).parent, store.chosen_by)
        return
    engine = create_engine(store.uri)
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
            connection.exec_driver_sql("CREATE TABLE dflash_write_check (x INTEGER)")
            connection.exec_driver_sql("ROLLBACK")
    except Exception as exc:  # sqlite3's OperationalError, wrapped by SQLAlchemy
        if "database is locked" in str(exc):
            return  # another job (of a sweep) is writing to it: it takes writes
        raise refusal(store, key, f"cannot be written ({first_line(exc)})") from exc
    finally:
        engine.dispose()


def check_store_answers(store: TrackingStore, *, key: str, connect_timeout_s: float) -> None:
    """One request, no retries, `connect_timeout_s` to answer. It runs on a thread of its own: a
    database backend retries its connection on its own clock, which no HTTP setting bounds."""
    client_class = import_mlflow(store, key)
    outcome: list[BaseException | None] = []

    def ask() -> None:
        try:
            client_class(tracking_uri=store.uri).search_experiments(max_results=1)
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)

    with mlflow_http_settings(timeout_s=connect_timeout_s):
        asker = threading.Thread(target=ask, name="dflash-mlflow-check", daemon=True)
        asker.start()
        asker.join(connect_timeout_s + 5.0)  # the HTTP timeout fires first; this bounds the rest
    if not outcome:
        raise refusal(store, key, f"does not answer within {connect_timeout_s:g} s")
    if outcome[0] is not None:
        raise refusal(store, key, request_failure(outcome[0], connect_timeout_s))


@contextmanager
def mlflow_http_settings(*, timeout_s: float) -> Iterator[None]:
    """MLflow's own HTTP settings for one request: no retries, `timeout_s` to connect and answer
    (MLflow reads them at each request); the caller's values are restored after."""
    settings = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, round(timeout_s))),
    }
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def request_failure(exc: BaseException, timeout_s: float) -> str:
    """Why a request failed, in a few words (MLflow's message carries urllib3's whole retry
    report)."""
    text = str(exc)
    if "timed out" in text.lower():
        return f"does not answer within {timeout_s:g} s"
    errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno:
        return f"does not answer ({errno.group(1).strip()})"
    line = first_line(exc)
    return f"refused the request ({line if len(line) <= 200 else line[:200] + ' ...'})"


def check_mlflow_destination(destination: SinkDestination) -> None:
    """logger.sinks.NAME of an MLflow sink, before any weights load: the store it will log to."""
    store = tracking_store(
        key=destination.key,
        tracking_uri=destination.settings["tracking_uri"],
        resumed=resumed_mlflow_run(destination.resume_dir),
        resume_dir=destination.resume_dir,
        run_dir=destination.run_dir,
    )
    check_store(store, key=destination.key, connect_timeout_s=destination.settings["connect_timeout_s"])
