"""`dflash-export check DIR [--target TARGET_DIR]`: does a drafter directory keep the export
contract every serving reader relies on (docs/EXPORT.md)? One line per problem on stderr and exit
2 on any; one `ok` line and exit 0 otherwise.

    dflash-export check outputs/run/checkpoints/last
    dflash-export check outputs/run/checkpoints/last --target /models/Qwen3-8B   # + the pairing

`--target`: the target's checkpoint directory (its config.json; for an image-text checkpoint its
`text_config`): the drafter's num_target_layers, hidden size and mask id are checked against it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dflash.errors import USER_ERROR_EXIT, exit_for_user_error
from dflash.export.contract import check_export
from dflash.models.families import IMAGE_TEXT_TYPES

TOOL = "dflash-export"


def target_text_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        exit_for_user_error(TOOL, f"--target {directory}: no readable config.json ({exc})")
    if config.get("model_type") in IMAGE_TEXT_TYPES:
        config = config.get("text_config", {})
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in config]
    if missing:
        exit_for_user_error(TOOL, f"--target {path}: no {', '.join(missing)} in the (text) config")
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=TOOL, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a drafter directory against the export contract")
    check.add_argument("directory", type=Path)
    check.add_argument("--target", type=Path, help="the target's checkpoint directory, for the pairing rules")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        exit_for_user_error(TOOL, f"{args.directory}: no such directory")
    target = target_text_config(args.target) if args.target is not None else None
    problems = check_export(args.directory, target=target)
    for problem in problems:
        print(f"{TOOL}: {problem}", file=sys.stderr)
    if problems:
        raise SystemExit(USER_ERROR_EXIT)
    print(f"ok: {args.directory} keeps the export contract (docs/EXPORT.md)")


if __name__ == "__main__":
    main()
