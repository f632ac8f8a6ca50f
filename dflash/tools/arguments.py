"""How the flag-taking commands read their command line: one program name, `dflash COMMAND`, in
their usage and in every error they print, whichever name started them (`dflash COMMAND` or the
older alias `dflash-COMMAND`: scripts keep working, and what they print is the name the docs
teach). The commands that also take the run's Hydra overrides (`dflash val`, `dflash schedule`)
refuse a flag they do not know and a typo in the overrides the way the Hydra commands do: one
line naming the flag or the key, exit 2.

Nothing here imports torch: `dflash COMMAND --help` answers before any heavy import.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dflash.config.plugins import load_plugins_or_exit
from dflash.errors import exit_for_user_error, refuse_unquoted_home

if TYPE_CHECKING:
    from dflash.config.schema import Config


def command_name(command: str) -> str:
    """What a command calls itself in its usage and its errors."""
    return f"dflash {command}"


def command_parser(
    command: str, description: str | None, usage: str | None = None
) -> argparse.ArgumentParser:
    """The parser of `dflash COMMAND`, its module docstring as the help text (examples kept as
    written); `usage` where the command takes overrides, which argparse does not list."""
    return argparse.ArgumentParser(
        prog=command_name(command),
        usage=usage,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def flags_and_overrides(
    parser: argparse.ArgumentParser, argv: list[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """The command's flags, and the rest as Hydra overrides. A word that is no override (an
    unknown `--flag`, a stray word) is refused by the parser, not handed to Hydra, whose lexer
    error would name neither."""
    args, rest = parser.parse_known_args(argv)
    strays = [word for word in rest if word.startswith("-") or "=" not in word]
    if strays:
        parser.error(f"unrecognized arguments: {' '.join(strays)} (overrides are key=value)")
    return args, rest


def composed_or_refused(command: str, overrides: list[str]) -> Config:
    """The typed run config of `overrides`, or exit 2 with one line naming the key (the Hydra
    commands' refusal, dflash/tools/hydra_app.py)."""
    from dflash.tools.compose import compose_typed
    from dflash.tools.hydra_app import composition_error

    refuse_unquoted_home(command_name(command), overrides)
    load_plugins_or_exit(command_name(command))  # a plug-in's options compose, its checkpoints read
    try:
        return compose_typed(overrides)
    except Exception as exc:
        line = composition_error(exc) or (str(exc) if isinstance(exc, ValueError) else None)
        if line is None:
            raise
        exit_for_user_error(command_name(command), line)
