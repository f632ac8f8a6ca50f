"""Hydra callbacks. `RunRecordCallback` writes `run.json` into every job dir, under any launcher
(basic, multirun, submitit/SLURM), also when the job fails; before Hydra writes anything into a
run (or sweep) dir it takes the dir's lock, so a second live run into it is refused.

run.json: resolved config, group choices, overrides, versions of dflash and its libraries, the
git commit of the code, the devices, start/end time, exit status (with the error of a failed
job), final metrics, the start-up feature check's figures, and the dflash threads alive when the job started (multirun runs jobs in one
process: a thread left by an earlier job would show here).
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dflash.errors import exit_for_user_error, full_errors_requested
from dflash.lock import RunDirInUse, RunDirLock, holds_run_dir_lock, launch_rank
from dflash.run.ownership import refuse_earlier_run, refuse_earlier_sweep
from dflash.run.sweep_results import SweepResults
from dflash.target.feature_check import REPORT_FILE as FEATURE_CHECK_FILE
from dflash.trainer.signals import (
    StopRequested,
    begin_shutdown,
    ignore_signals_until_exit,
    install_job_signals,
    late_signal,
    restore_job_signals,
)

LIBRARIES = (
    "dflash",
    "torch",
    "transformers",
    "hydra-core",
    "omegaconf",
    "safetensors",
    "numpy",
    # the trackers' libraries (optional: "not installed" where absent)
    "wandb",
    "tensorboard",
    "mlflow-skinny",
)


# Config keys whose values are secrets: never written in clear into a record (run.json, .hydra/).
_SECRET_KEY = re.compile(r"(api_key|password|secret)", re.IGNORECASE)
# `key=value` inside an override string or Hydra's override_dirname.
_SECRET_OVERRIDE = re.compile(
    r"((?:^|[,\s])[+~]*[\w.]*(?:api_key|password|secret)[\w]*=)[^,\s]*", re.IGNORECASE
)
MASK = "***"


def masked(value: Any) -> Any:
    """`value` (a config container, an override list or string) with every secret replaced by ***."""
    if isinstance(value, dict):
        return {
            k: MASK if _SECRET_KEY.search(str(k)) and v not in (None, "") else masked(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [masked(v) for v in value]
    if isinstance(value, str):
        return _SECRET_OVERRIDE.sub(lambda m: m.group(1) + MASK, value)
    return value


def mask_hydra_files(output_dir: Path, subdir: str | None) -> None:
    """Hydra writes config.yaml, hydra.yaml and overrides.yaml before the job starts: rewrite
    them with secrets masked (a key typed on the command line would sit there in clear)."""
    if subdir is None:
        return
    for path in (output_dir / subdir).glob("*.yaml"):
        original = yaml.safe_load(path.read_text())
        hidden = masked(original)
        if hidden != original:
            replace_text(path, yaml.safe_dump(hidden, sort_keys=False))


def replace_text(path: Path, text: str) -> None:
    """`path` holds `text` afterwards or, where a signal or a full disk cuts the write, what it
    held before: written to a hidden sibling renamed over it, and the sibling never stays."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file the run wrote, or {} where the run ended before writing it."""
    return json.loads(path.read_text()) if path.is_file() else {}


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def git_commit(directory: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def device_inventory() -> dict[str, Any]:
    import torch

    cuda = []
    if torch.cuda.is_available():
        cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"host": platform.node(), "cpu_count": os.cpu_count(), "cuda_devices": cuda}


def dflash_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("dflash-"))


class RunRecordCallback(Callback):
    def __init__(self, filename: str = "run.json", max_failed_jobs: int | None = None) -> None:
        self.filename = filename
        # A search (Optuna) stops after this many failed trials (None: never stops for failures).
        self.max_failed_jobs = max_failed_jobs
        self._sweep: SweepResults | None = None  # a search's results file, written per trial
        self._started: dict[str, float] = {}
        self._threads_at_start: dict[str, list[str]] = {}
        self._lock: RunDirLock | None = None
        self._output_locks: dict[str, RunDirLock] = {}  # job dir -> the lock on its paths.output_dir
        self._signal_handlers: dict = {}  # the SIGINT / SIGTERM handlers before the job

    # The lock is taken before Hydra writes .hydra/ into the dir, and held until the run or
    # sweep ends (or the process dies). Hydra turns a callback's exception into a warning and
    # goes on, so a refusal exits here (SystemExit is not an Exception).
    def _lock_dir(self, directory: str) -> None:
        if not holds_run_dir_lock():
            return
        try:
            self._lock = RunDirLock(directory).acquire()
        except RunDirInUse as exc:
            exit_for_user_error(tool_name(), str(exc))
        except OSError as exc:  # a read-only mount, /proc, a full disk, no permission
            exit_for_user_error(
                tool_name(),
                f"cannot write the run dir {directory} ({exc.strerror}); set hydra.run.dir to a writable place",
            )

    def _refuse_owned_dir(self, check) -> None:
        """A directory that holds another run (or sweep) is refused before Hydra writes its
        `.hydra/` and train.log there, and before any record: the refusal leaves it untouched."""
        if not holds_run_dir_lock():
            return
        try:
            check()
        except ValueError as exc:
            self._unlock()
            exit_for_user_error(tool_name(), str(exc))

    def _record_trial(self, hydra_cfg: Any, record: dict[str, Any], job_return: JobReturn) -> None:
        """Into the search's results file; past `max_failed_jobs` failures the search stops (in
        one line, the file written)."""
        self._sweep.add(
            number=int(hydra_cfg.job.get("num") or 0),
            overrides=list(record["overrides"]),
            status=record["status"],
            value=_objective_value(job_return),
            error=record["error"],
        )
        if self.max_failed_jobs is not None and self._sweep.failed > self.max_failed_jobs:
            self._unlock()
            print(
                f"{tool_name()}: error: {self._sweep.failed} trials failed, more than "
                f"hydra.callbacks.run_record.max_failed_jobs={self.max_failed_jobs}: search stopped; "
                f"trials and the best so far in {self._sweep.path}",
                file=sys.stderr,
                flush=True,
            )
            ignore_signals_until_exit()
            raise SystemExit(1)

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        run_dir = expand_home_dir(config, "run")
        self._lock_dir(run_dir)
        resume = OmegaConf.select(config, "resume", default=None)
        self._refuse_owned_dir(lambda: refuse_earlier_run(Path(run_dir), resume=resume, key="hydra.run.dir"))

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._unlock()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        expand_home_dir(config, "sweep")
        self._lock_dir(config.hydra.sweep.dir)
        sweeper = config.hydra.sweeper
        if "optuna" in str(sweeper.get("_target_", "")).lower() and holds_run_dir_lock():
            direction = sweeper.get("direction", "minimize")
            self._sweep = SweepResults(
                Path(config.hydra.sweep.dir),
                params=searched_keys(sweeper.get("params") or {}, list(config.hydra.overrides.task)),
                direction=str(direction) if isinstance(direction, str) else "multi",
            )
        self._refuse_owned_dir(lambda: refuse_earlier_sweep(Path(config.hydra.sweep.dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self._sweep is not None and self._sweep.path.is_file():
            # The sweeper has written its own best (it may hold more, e.g. a Pareto front): kept,
            # with the trials beside it.
            self._sweep.write(yaml.safe_load(self._sweep.path.read_text()) or {})
        self._unlock()

    def _lock_output_dir(self, job_dir: str, config: DictConfig) -> None:
        """paths.output_dir, unless it is the run dir this process locked already: two live
        runs writing one would interleave their metrics and overwrite their checkpoints. A
        sweep's job dirs are locked here too (the sweep dir's lock does not cover them: a run
        started into one while its job lives would rewrite its .hydra/ and record)."""
        output_dir = OmegaConf.select(config, "paths.output_dir", default=None)
        if not output_dir or not holds_run_dir_lock():
            return
        output_dir = os.path.expanduser(output_dir)  # as the run will (dflash/config/typed.py)
        locked = Path(self._lock.directory).resolve() if self._lock is not None else None
        if Path(output_dir).resolve() == Path(job_dir).resolve() == locked:
            return
        try:
            self._output_locks[job_dir] = RunDirLock(output_dir).acquire()
        except RunDirInUse as exc:
            exit_for_user_error(tool_name(), f"paths.output_dir: {exc}")
        except OSError as exc:
            exit_for_user_error(
                tool_name(), f"paths.output_dir={output_dir}: cannot write it ({exc.strerror})"
            )

    def _release_output_dir(self, job_dir: str) -> None:
        lock = self._output_locks.pop(job_dir, None)
        if lock is not None:
            lock.release()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        hydra_cfg = HydraConfig.get()
        output_dir = hydra_cfg.runtime.output_dir
        mask_hydra_files(Path(output_dir), hydra_cfg.output_subdir)
        self._lock_output_dir(str(Path(output_dir)), config)
        self._started[output_dir] = time.time()
        self._threads_at_start[output_dir] = dflash_threads()
        self._signal_handlers = install_job_signals()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        begin_shutdown()  # a Ctrl-C now is noted, not raised: the record is written whole
        hydra_cfg = HydraConfig.get()
        output_dir = Path(hydra_cfg.runtime.output_dir)
        failed = job_return.status == JobStatus.FAILED
        error = job_return._return_value if failed else None
        stopped = isinstance(error, StopRequested)
        record = {
            "status": "INTERRUPTED" if stopped else "FAILED" if failed else "COMPLETED",
            "signal": signal.Signals(error.signum).name if stopped else None,
            "error": f"{type(error).__name__}: {error}" if failed else None,
            "traceback": "".join(traceback.format_exception(error)) if failed else None,
            "start_time": self._started.pop(str(output_dir), None),
            "end_time": time.time(),
            "job": {"name": hydra_cfg.job.name, "num": hydra_cfg.job.get("num"), "mode": str(hydra_cfg.mode)},
            "choices": OmegaConf.to_container(hydra_cfg.runtime.choices),
            "overrides": masked(list(hydra_cfg.overrides.task)),
            "config": masked(_resolved(config)),
            "versions": library_versions(),
            "git": git_commit(Path(__file__).resolve().parent),
            "devices": device_inventory(),
            "threads_at_start": self._threads_at_start.pop(str(output_dir), []),
            "metrics": read_json(output_dir / "summary.json"),
            "feature_check": read_json(output_dir / FEATURE_CHECK_FILE),
        }
        # torchrun ranks share the dir: rank 0 writes run.json, the others run.rank<r>.json.
        rank = launch_rank()
        filename = self.filename if rank == 0 else self.filename.replace(".json", f".rank{rank}.json")
        write_record(output_dir / filename, record)
        self._release_output_dir(str(output_dir))
        if self._sweep is not None and hydra_cfg.mode == RunMode.MULTIRUN:
            self._record_trial(hydra_cfg, record, job_return)
        signum = error.signum if stopped else late_signal()
        if signum is not None:
            # A signalled job ends the process (a sweep too) with 128 + signal, as schedulers
            # expect; raised here, after the record, since Hydra would report it as a failure.
            self._unlock()
            ignore_signals_until_exit()
            raise SystemExit(128 + signum)
        restore_job_signals(self._signal_handlers)
        if failed and is_user_error(error) and hydra_cfg.mode == RunMode.RUN:
            # One line instead of Hydra's traceback; the traceback stays in the record. (A sweep
            # records the failed job and goes on.) HYDRA_FULL_ERROR=1 adds the traceback to
            # stderr; the exit code stays a user error's, so scripts read the same outcome.
            self._unlock()
            if full_errors_requested():
                traceback.print_exception(error, file=sys.stderr)
            exit_for_user_error(tool_name(), f"{error}  [traceback: {output_dir / filename}]")


def searched_keys(params: Any, overrides: list[str]) -> list[str]:
    """The keys a search varies: its config's `params` and the command line's sweeps
    (`key=choice(...)`, `interval(...)`, `range(...)`, `a,b`)."""
    keys = list(params.keys())
    for override in overrides:
        key, _, value = override.partition("=")
        if re.match(r"^(choice|range|interval|tag)\(|^[^'\"\[{(]*,", value) and key not in keys:
            keys.append(key)
    return keys


def _objective_value(job_return: JobReturn) -> float | None:
    try:
        return float(job_return._return_value) if job_return.status == JobStatus.COMPLETED else None
    except (TypeError, ValueError):
        return None


def expand_home_dir(config: DictConfig, mode: str) -> str:
    """hydra.run.dir / hydra.sweep.dir with a leading `~` expanded before Hydra creates it (it
    would make a directory named `~` under the working directory)."""
    directory = str(config.hydra[mode].dir)
    if directory.startswith("~"):
        with open_dict(config.hydra), read_write(config.hydra):
            config.hydra[mode].dir = os.path.expanduser(directory)
    return str(config.hydra[mode].dir)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """run.json, atomically; when it cannot be written (a full disk), no temporary file stays and
    the record's status and error go to stderr instead, so the outcome is never lost."""
    try:
        replace_text(path, json.dumps(record, indent=2, default=str) + "\n")
    except OSError as exc:
        print(
            f"{tool_name()}: cannot write the run record {path} ({exc.strerror or exc}); "
            f"status {record['status']}" + (f": {record['error']}" if record.get("error") else ""),
            file=sys.stderr,
        )
        if record.get("traceback"):
            print(record["traceback"], file=sys.stderr)


def is_user_error(error: BaseException) -> bool:
    """Bad config, a missing or unreadable file, an unwritable dir, a full disk: what the user
    fixes. dflash raises ValueError naming the key, file or path for every such mistake."""
    return isinstance(error, (ValueError, OSError))


def tool_name() -> str:
    name = Path(sys.argv[0]).name  # `dflash train` (dflash/cli.py names it so) or `dflash-train`
    return name if name.startswith(("dflash-", "dflash ")) else "dflash"


def _resolved(config: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(config, resolve=True, enum_to_str=True)
    except Exception:  # an unresolvable value (the failure itself, maybe): keep what can be kept
        return OmegaConf.to_container(config, resolve=False, enum_to_str=True)
