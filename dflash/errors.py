"""How the command-line tools end on a user's mistake: one line naming the key, file or path and
what to do, and exit code 2 (internal errors keep their traceback and exit 1).
`HYDRA_FULL_ERROR=1` prints the whole traceback of a user error too, before that line; the exit
code stays 2.
"""

from __future__ import annotations

import os
import sys

USER_ERROR_EXIT = 2


def exit_for_user_error(tool: str, message: str) -> None:
    """Print `<tool>: error: <message>` to stderr and exit with USER_ERROR_EXIT."""
    print(f"{tool}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_EXIT)


def full_errors_requested() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def refuse_unquoted_home(tool: str, overrides: list[str]) -> None:
    """`key=~/path`: Hydra's override grammar reads `~` as an operator and fails with a lexer
    error that names neither the key nor the fix; say it in one line instead."""
    for override in overrides:
        key, equals, value = override.partition("=")
        if equals and value.startswith("~") and not key.startswith("-"):
            exit_for_user_error(
                tool,
                f"{override}: Hydra's override grammar reserves '~'; quote the value for Hydra "
                f"(\"{key}='{value}'\", expanded to your home directory) or write the full path",
            )
