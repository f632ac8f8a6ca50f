"""What every metric sink shares: the protocol a sink keeps, the context it is built with, the
optional library a tracker needs, and the Hydra facts (sweep naming, composed options) trackers
name their runs by."""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


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
class SinkDestination:
    """A `logger.sinks` entry as its destination check sees it, before any weights load: the
    entry's key (logger.sinks.NAME), the run dir, the checkpoint a resumed run continues, and
    the settings the sink will be built with (the entry's keys over its signature's defaults)."""

    key: str
    run_dir: Path
    resume_dir: Path | None
    settings: dict[str, Any]


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


def sweep_naming() -> tuple[str | None, str | None]:
    """(group, name) for a job of a Hydra multirun: the sweep dir and the job's own overrides."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None, None
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.sweep.dir).name, hydra_cfg.job.override_dirname or None


def hydra_choice(group: str) -> str | None:
    """The option of a config group this run was composed with (None outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get(group)


def refuse_unwritable_dir(directory: Path, key: str) -> None:
    """A directory a sink will create and write, checked before any weights load: its nearest
    existing ancestor must be a directory that takes a file (a permission bit can say yes to
    root on a read-only mount, so a file is written and removed instead of asking)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{key}: {directory} cannot be a directory ({existing} is a file)")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ValueError(f"{key}: cannot write {directory} ({exc.strerror or exc})") from exc
