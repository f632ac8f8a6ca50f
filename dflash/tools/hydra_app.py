"""How the Hydra commands (`dflash train|eval|regen|prep|served`) start: their entry (`main`, made
by hydra_command from the job function and its help), their help, `--version`, the plug-ins (dflash/config/plugins.py) imported before the config is composed, and one line with
exit 2 for a mistake in the overrides, Hydra's composition errors included.

Hydra reports a composition error (an unknown key, an option that does not exist, a value of the
wrong type) in several lines with exit 1, and for an unknown key it suggests the `+key=value` form
that dflash then refuses (dflash/config/keys.py). Here such an error becomes what every other
user error of dflash is (dflash/errors.py): `<tool>: error: <one line naming the key>`, with the
nearest known key or option where there is one, and exit 2. Errors raised inside a job are left to
the run record callback (dflash/run/record.py), as before.
"""

from __future__ import annotations

import difflib
import sys
import traceback
from collections.abc import Callable
from importlib import resources
from typing import Any

import hydra
from omegaconf import DictConfig

from dflash import __version__
from dflash.config.plugins import load_plugins_or_exit
from dflash.errors import exit_for_user_error, full_errors_requested, refuse_unquoted_home
from dflash.tools.compose import CONF_MODULE, CONF_PATH

# The end of the line for a group option nothing resembles: it may be a plug-in's, not given here.
PLUGIN_OPTION_HINT = (
    "an option of your own needs its plug-in (DFLASH_PLUGINS, or a dflash.plugins entry point)"
)

# Guides, in the source repository's docs/ (README.md links them all).
GUIDES = (
    "docs/quickstart.md (your model on one GPU), README.md (set-up, configuration),\n"
    "        docs/real-data.md, docs/several-gpus.md, docs/sweeps.md, docs/extending.md, docs/EXPORT.md"
)


def group_options(config_name: str) -> dict[str, list[str]]:
    """Each config group the command composes from and its options: the YAML files of the
    package's conf/ (the component schemas live apart, under schema/, and are no options)."""
    root = resources.files(CONF_MODULE)
    groups: dict[str, list[str]] = {}

    def walk(directory, prefix: str) -> None:
        for entry in sorted(directory.iterdir(), key=lambda e: e.name):
            if entry.is_dir() and not entry.name.startswith(("_", ".")):
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".yaml") and prefix:
                groups.setdefault(prefix.rstrip("/"), []).append(entry.name.removesuffix(".yaml"))

    walk(root, "")
    groups.pop("hydra", None)  # Hydra's own settings (run dirs, callbacks), not a choice
    if config_name == "regen":  # regen composes only the target and paths groups
        return {g: o for g, o in groups.items() if g in ("target", "paths", "hydra/launcher")}
    return groups


def app_help(*, tool: str, summary: str, config_name: str, overrides: tuple[str, ...]) -> str:
    groups = group_options(config_name)
    width = max(len(g) for g in groups)
    lines = [
        f"usage: {tool} [OVERRIDE ...]   (key=value, group=option; --cfg job prints the composed config)",
        "",
        summary.strip(),
        "",
        "config groups (group=option; * marks the default):",
    ]
    defaults = _defaults(config_name)
    for group, options in groups.items():
        marked = [f"{o}*" if defaults.get(group) == o else o for o in options]
        lines.append(f"  {group:<{width}}  {', '.join(marked)}")
    lines += ["", "common overrides:", *(f"  {o}" for o in overrides)]
    lines += [
        "",
        "more: --cfg job (the composed config), --info defaults-tree, --hydra-help (Hydra's own flags),",
        "      -m key=a,b (a sweep: docs/sweeps.md)",
        f"guides: {GUIDES}",
        f"dflash {__version__}",
    ]
    return "\n".join(lines)


def _defaults(config_name: str) -> dict[str, str]:
    """The option each group takes by default (the primary config's defaults list)."""
    import yaml

    text = resources.files(CONF_MODULE).joinpath(f"{config_name}.yaml").read_text()
    chosen = {}
    for entry in yaml.safe_load(text).get("defaults", []):
        if isinstance(entry, dict):
            for group, option in entry.items():
                if isinstance(option, str):
                    chosen[group.removeprefix("override ").strip()] = option
    return chosen


def hydra_command(
    job: Callable[[DictConfig], Any],
    *,
    tool: str,
    summary: str,
    config_name: str,
    overrides: tuple[str, ...],
) -> Callable[[], None]:
    """The entry point (`main`: `dflash COMMAND` and pyproject.toml's alias) of the Hydra command
    `tool`: `job` run on the config `config_name` of the package's conf/, by run_hydra_app.

    `job` itself is what `hydra.main` decorates: Hydra names the job (`hydra.job.name`, in the run
    record and a job's `<name>.log`) after the module of the function it decorates
    (hydra/_internal/utils.py: detect_calling_file_or_module_from_task_function), so a job defined
    in dflash/tools/prep.py runs as `prep`, as it did when each command decorated its own."""
    hydra_main = hydra.main(version_base="1.3", config_path=CONF_PATH, config_name=config_name)(job)

    def main() -> None:
        run_hydra_app(hydra_main, tool=tool, summary=summary, config_name=config_name, overrides=overrides)

    main.__doc__ = f"`{tool}`."
    return main


def run_hydra_app(
    hydra_main: Callable[[], Any],
    *,
    tool: str,
    summary: str,
    config_name: str,
    overrides: tuple[str, ...],
) -> Any:
    """Call a `hydra.main`-decorated function as the command `tool`: `--help` / `-h` print the
    app help, `--version` dflash's version, and a composition error exits 2 in one line."""
    args = sys.argv[1:]
    if "--help" in args or "-h" in args:
        print(app_help(tool=tool, summary=summary, config_name=config_name, overrides=overrides))
        raise SystemExit(0)
    if "--version" in args:
        print(f"dflash {__version__}")
        raise SystemExit(0)
    refuse_unquoted_home(tool, args)  # Hydra's lexer error for `key=~/path` names no fix
    # Before composing: a plug-in's `variant=NAME` option and drafter class are registered by then.
    load_plugins_or_exit(tool)
    from hydra._internal import utils as hydra_utils

    hydra_report = hydra_utils.run_and_report

    def run_and_report(func: Callable[[], Any]) -> Any:
        def composed_or_refused() -> Any:
            try:
                return func()
            except Exception as exc:
                line = composition_error(exc, config_name=config_name)
                if line is None:
                    raise
                if full_errors_requested():
                    traceback.print_exc()
                exit_for_user_error(tool, line)  # SystemExit: Hydra's own reporting lets it through

        return hydra_report(composed_or_refused)

    # Hydra reads the name at call time (hydra/_internal/utils.py: _run_hydra), so the wrapper
    # sees every error of composition before Hydra prints it.
    hydra_utils.run_and_report = run_and_report
    # The errors a job raises are named after sys.argv[0] (dflash/run/record.py: tool_name):
    # `dflash train`, as the front door names it, also when the alias dflash-train started it.
    program = sys.argv[0]
    sys.argv[0] = tool
    try:
        return hydra_main()
    finally:
        hydra_utils.run_and_report = hydra_report
        sys.argv[0] = program


def composition_error(exc: BaseException, *, config_name: str = "config") -> str | None:
    """One line for an error of composing the overrides (None: not such an error)."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    if isinstance(exc, MissingConfigException):
        return _missing_option(exc)
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the override: {_first_line(str(exc))}"
    if not isinstance(exc, ConfigCompositionException):
        return None
    cause = exc.__cause__
    message = _first_line(str(exc))
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and getattr(cause, "full_key", None):
        return unknown_key_line(cause.full_key, config_name=config_name)
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        override = message.removeprefix("Error merging override ")
        return f"{cause.full_key}: {_first_line(cause.msg)} (override {override})"
    if message.startswith("Could not override '") and "No match in the defaults list" in str(exc):
        group = message.split("'")[1]
        groups = sorted(group_options(config_name))
        close = difflib.get_close_matches(group, groups, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f"; groups: {', '.join(groups)}"
        return f"{group}: no such config group{hint}"
    return message + (f": {_first_line(str(cause))}" if cause is not None else "")


def unknown_key_line(key: str, *, config_name: str) -> str:
    from dflash.config.keys import unknown_key_message

    return unknown_key_message(key, known_keys(config_name))


def known_keys(config_name: str) -> set[str]:
    """Every dotted key a dflash config can hold: the root schema's fields and each component
    option's own (MaskRampNoiseConfig's `noise.start`)."""
    from dflash.config.keys import schema_keys
    from dflash.config.schema import COMPONENT_OPTIONS, Config, RegenConfig

    if config_name == "regen":
        return schema_keys(RegenConfig)[0]
    known = schema_keys(Config)[0]
    for group, options in COMPONENT_OPTIONS.items():
        for node in options.values():
            known |= schema_keys(node, f"{group}.")[0]
    return known


def _missing_option(exc) -> str:
    """`scheduler=shufle`: the group's options (schemas are none of them) and the nearest one."""
    missing = (exc.missing_cfg_file or "").rstrip("/")
    group, _, option = missing.rpartition("/")
    if not group:
        return _first_line(str(exc))
    options = sorted(o for o in (exc.options or []) if not o.startswith("_"))
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.5)
    hint = f"; did you mean {group}={close[0]}?" if close else f"; {PLUGIN_OPTION_HINT}"
    return f"{group}={option}: no such option (options: {', '.join(options)}){hint}"


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)
