"""A run directory (and any output file a tool appends to) belongs to one live process.

Two runs writing one directory interleave their metrics, checkpoints and records, and both exit
0. The first to start takes an exclusive lock on `<dir>/.dflash.lock` (flock: the OS releases
it when the process dies, however it dies) and writes its pid, host and start time there; a
second run into the same directory is refused naming them. Under torchrun every rank shares
the run dir: rank 0 holds the lock for all of them. `FileLock` is the same lock on any path
(dflash-regen holds one beside its output).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

LOCK_FILE = ".dflash.lock"


class RunDirInUse(ValueError):
    """Another live process holds the run directory."""


class FileLock:
    """An exclusive flock on `path` (created), holding this process's pid, host and start time;
    `in_use(holder)` is the error raised when another live process holds it (`holder`: who)."""

    def __init__(self, path: Path | str, in_use: Callable[[str], ValueError]):
        self.path = Path(path)
        self._in_use = in_use
        self._fd: int | None = None

    def acquire(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            raise self._in_use(describe(holder)) from None
        os.ftruncate(fd, 0)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        os.write(fd, json.dumps({"pid": os.getpid(), "host": platform.node(), "started": started}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


class RunDirLock(FileLock):
    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        super().__init__(
            self.directory / LOCK_FILE,
            lambda holder: RunDirInUse(
                f"run dir {self.directory} belongs to a run still alive ({holder}); "
                "give this run its own hydra.run.dir (or wait for that one to end)"
            ),
        )


def describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


def launch_rank() -> int:
    """This process's rank as the launcher set it (torchrun, submitit), read before any process
    group exists; 0 for a single process."""
    return int(os.environ.get("RANK", "0"))


def holds_run_dir_lock() -> bool:
    """Whether this process takes the lock: the only process, or torchrun's rank 0."""
    return launch_rank() == 0
