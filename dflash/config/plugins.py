"""Plug-ins: modules of the user's own that every dflash command imports before it composes a
config or reads a checkpoint, so what they register (a drafter variant's drafter class, training
side and `variant=NAME` option) is known to `dflash train`, a resume, `dflash eval`,
`dflash export`, `dflash val` and `dflash served` alike, with no launcher script.

Two ways to declare one, read by every command, in this order:
- installed with a package: an entry point of the group `dflash.plugins` (pyproject.toml:
  `[project.entry-points."dflash.plugins"] my_variant = "my_pkg.my_variant"`);
- ad hoc: `DFLASH_PLUGINS=my_variants,my_other_module`, module names importable from sys.path
  (PYTHONPATH holds their directory).

An environment variable rather than a flag: every process of a command inherits it (torchrun's
ranks, a sweep launcher's jobs, `dflash-train` and `python -m dflash.train`), and no command's
parser has to keep a flag of its own apart from Hydra's overrides.

Only names the user declared are imported: a checkpoint names the plug-in it needs
(dflash/drafters/plugin_record.py) but is never allowed to import code itself.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

from dflash.errors import exit_for_user_error, full_errors_requested

ENTRY_POINT_GROUP = "dflash.plugins"
ENV_VAR = "DFLASH_PLUGINS"


class PluginError(ValueError):
    """A declared plug-in that cannot be imported (a ValueError: a user's mistake, one line)."""


@dataclass(frozen=True)
class Plugin:
    module: str  # what is imported: a module, or an entry point's `module:attribute`
    declared_by: str  # where, for the error line: the entry point and its distribution, or the variable

    def load(self) -> None:
        module, _, attribute = self.module.partition(":")
        try:
            loaded = importlib.import_module(module)
            if attribute:  # the entry point's form `module:attribute` names an object in it
                for name in attribute.split("."):
                    loaded = getattr(loaded, name.strip())
        except Exception as exc:  # whatever the module raises on import: a missing dependency, a typo
            # The plug-in itself is nowhere on the path (not a module it imports): say where to put it.
            missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
            unfound = missing is not None and f"{module}.".startswith(f"{missing}.")
            hint = " (put its directory on PYTHONPATH, or install its package)" if unfound else ""
            raise PluginError(
                f"plug-in {self.module} ({self.declared_by}) cannot be imported: "
                f"{type(exc).__name__}: {_one_line(str(exc))}{hint}"
            ) from exc


def declared_plugins(environ: Mapping[str, str] | None = None) -> list[Plugin]:
    """The installed packages' `dflash.plugins` entry points (by distribution, then name), then
    the modules DFLASH_PLUGINS names, in its order; a module declared twice is imported once.
    `environ`: the process environment as it is at the call (None), not as it was at import."""
    environ = os.environ if environ is None else environ
    found = []
    entry_points = sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=_distribution_and_name)
    for entry_point in entry_points:
        distribution = _distribution_and_name(entry_point)[0] or "an installed package"
        found.append(Plugin(entry_point.value, f"entry point {entry_point.name} of {distribution}"))
    for name in environ.get(ENV_VAR, "").split(","):
        name = name.strip()
        if not name:
            continue
        # A file's name or path is the likely slip: `my_variants.py` would import `my_variants.py`.
        is_file = name.endswith(".py") or os.sep in name or "/" in name
        if is_file or not all(part.isidentifier() for part in name.split(".")):
            module = os.path.basename(name).removesuffix(".py")
            raise PluginError(
                f"{ENV_VAR}={environ[ENV_VAR]}: {name!r} is not a module name (name the module, "
                f"{module}, and put its directory on PYTHONPATH)"
            )
        found.append(Plugin(name, ENV_VAR))
    unique: dict[str, Plugin] = {}
    for plugin in found:
        unique.setdefault(plugin.module, plugin)
    return list(unique.values())


def load_plugins(environ: Mapping[str, str] | None = None) -> list[Plugin]:
    """Import every declared plug-in (each once per process: Python keeps the modules it
    imported); PluginError naming the first that fails."""
    plugins = declared_plugins(environ)
    for plugin in plugins:
        plugin.load()
    return plugins


def load_plugins_or_exit(tool: str) -> None:
    """`load_plugins` for a command: a plug-in that fails ends it in one line and exit 2 (the
    traceback first with HYDRA_FULL_ERROR=1, as for every user error)."""
    try:
        load_plugins()
    except PluginError as exc:
        if full_errors_requested():
            traceback.print_exc()
        exit_for_user_error(tool, str(exc))


def _distribution_and_name(entry_point: metadata.EntryPoint) -> tuple[str, str]:
    distribution = entry_point.dist.name if entry_point.dist is not None else ""
    return distribution, entry_point.name


def _one_line(text: str) -> str:
    """A multi-line message (a SyntaxError's context, a chained report) on one line."""
    return " ".join(text.split())
