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
from omegaconf import DictConfig, OmegaConf

from dflash.errors import exit_for_user_error, full_errors_requested
from dflash.lock import RunDirInUse, RunDirLock, holds_run_dir_lock, launch_rank
from dflash.models.feature_check import REPORT_FILE as FEATURE_CHECK_FILE
from dflash.trainer.signals import StopRequested

LIBRARIES = ("dflash", "torch", "transformers", "hydra-core", "omegaconf", "safetensors", "wandb", "numpy")


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
            path.write_text(yaml.safe_dump(hidden, sort_keys=False))


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
    def __init__(self, filename: str = "run.json") -> None:
        self.filename = filename
        self._started: dict[str, float] = {}
        self._threads_at_start: dict[str, list[str]] = {}
        self._lock: RunDirLock | None = None
        self._output_locks: dict[str, RunDirLock] = {}  # job dir -> the lock on its paths.output_dir

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

    def _unlock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._lock_dir(config.hydra.run.dir)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._unlock()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._lock_dir(config.hydra.sweep.dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._unlock()

    def _lock_output_dir(self, job_dir: str, config: DictConfig) -> None:
        """paths.output_dir, where it is not the job dir (which is locked already): two live
        runs writing one would interleave their metrics and overwrite their checkpoints."""
        output_dir = OmegaConf.select(config, "paths.output_dir", default=None)
        if not output_dir or not holds_run_dir_lock():
            return
        if Path(output_dir).resolve() == Path(job_dir).resolve():
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

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
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
        if stopped:
            # A signalled job ends the process (a sweep too) with 128 + signal, as schedulers
            # expect; raised here, after the record, since Hydra would report it as a failure.
            self._unlock()
            raise SystemExit(128 + error.signum)
        if failed and is_user_error(error) and hydra_cfg.mode == RunMode.RUN:
            # One line instead of Hydra's traceback; the traceback stays in the record. (A sweep
            # records the failed job and goes on.) HYDRA_FULL_ERROR=1 adds the traceback to
            # stderr; the exit code stays a user error's, so scripts read the same outcome.
            self._unlock()
            if full_errors_requested():
                traceback.print_exception(error, file=sys.stderr)
            exit_for_user_error(tool_name(), f"{error}  [traceback: {output_dir / filename}]")


def write_record(path: Path, record: dict[str, Any]) -> None:
    """run.json, atomically; when it cannot be written (a full disk), no temporary file stays and
    the record's status and error go to stderr instead, so the outcome is never lost."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
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
