"""`dflash-export check DIR [--target TARGET_DIR]`: does a drafter directory keep the export
contract every serving reader relies on (docs/EXPORT.md)? One line per problem on stderr and exit
2 on any; one `ok` line and exit 0 otherwise. Both layouts are checked: z-lab (what dflash
writes) and speculators.

    dflash-export check outputs/run/checkpoints/last
    dflash-export check outputs/run/checkpoints/last --target /models/Qwen3-8B   # + the pairing

`--target`: the target's checkpoint directory (its config.json; for an image-text checkpoint its
`text_config`): the drafter's num_target_layers, hidden size and mask id are checked against it.

A DSpark drafter (DeepSpec's layout, or speculators' `dspark`) is checked the same way; the
readers that refuse a well-formed one (a head type some engine does not build) are printed as
`note:` lines, exit 0.

`dflash-export convert SRC DST --layout speculators|zlab|deepspec [--target TARGET_DIR]
[--verifier NAME] [--num-anchors N]`: the drafter of SRC (any layout) written to DST in the one
named, checked before it is reported done. zlab holds DFlash drafters, deepspec DSpark ones,
speculators either. speculators and deepspec: with `--target`, self-contained (the target's
embedding and LM head bundled: DeepSpec's own loader reads them from the drafter directory);
`--verifier` (default: --target, else the run's target.path) names the target in
`speculators_config.verifier`; `--num-anchors` gives a DSpark drafter read from the speculators
layout (which does not record it) the `num_anchors` DeepSpec's loader asserts.

    dflash-export convert outputs/run/checkpoints/last drafter-speculators --layout speculators \
        --target /models/Qwen3-8B
    dflash-export convert /drafters/from-speculators drafter-zlab --layout zlab
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from dflash.errors import USER_ERROR_EXIT, exit_for_user_error
from dflash.export.contract import check_export, reader_limits
from dflash.export.zlab import export_deepspec, export_drafter, export_speculators, load_drafter
from dflash.models.dspark import DSparkDrafter
from dflash.models.families import IMAGE_TEXT_TYPES
from dflash.trainer.checkpoint import RUN_CONFIG_FILE

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


def verifier_of(source: Path, target: Path | None, name: str | None) -> dict[str, Any]:
    """speculators_config.verifier: the target's name (or path) and architectures."""
    architectures = []
    if target is not None:
        architectures = json.loads((target / "config.json").read_text()).get("architectures") or []
    if name is None and target is not None:
        name = str(target)
    run_yaml = source / RUN_CONFIG_FILE
    if name is None and run_yaml.is_file():
        name = ((yaml.safe_load(run_yaml.read_text()) or {}).get("target") or {}).get("path")
    if name is None:
        exit_for_user_error(
            TOOL, f"{source}: name the target the drafter serves with --target DIR or --verifier NAME"
        )
    return {"name_or_path": name, "architectures": architectures}


def report(directory: Path, target: dict[str, Any] | None) -> None:
    problems = check_export(directory, target=target)
    for problem in problems:
        print(f"{TOOL}: {problem}", file=sys.stderr)
    if problems:
        raise SystemExit(USER_ERROR_EXIT)
    print(f"ok: {directory} keeps the export contract (docs/EXPORT.md)")
    for limit in reader_limits(directory):
        print(f"note: {limit}")


def convert(args: argparse.Namespace, target: dict[str, Any] | None) -> None:
    if args.destination.exists() and any(args.destination.iterdir()):
        exit_for_user_error(TOOL, f"{args.destination}: not empty; convert writes a new directory")
    try:
        drafter = load_drafter(args.source)
        dspark = isinstance(drafter, DSparkDrafter)
        if dspark and args.layout == "zlab":
            exit_for_user_error(
                TOOL, f"{args.source}: a DSpark drafter; the z-lab layout has no heads: --layout deepspec"
            )
        if not dspark and args.layout == "deepspec":
            exit_for_user_error(TOOL, f"{args.source}: a DFlash drafter (no Markov head): --layout zlab")
        if args.layout in ("zlab", "deepspec"):
            if getattr(drafter.config, "num_target_layers", None) is None:
                # The speculators layout records no target depth; SGLang resolves layer ids by it.
                if target is None:
                    exit_for_user_error(
                        TOOL, f"{args.source} records no target depth (num_target_layers): give --target DIR"
                    )
                drafter.config.num_target_layers = target["num_hidden_layers"]
            if dspark and getattr(drafter.config, "num_anchors", None) is None:
                if args.num_anchors is None:
                    exit_for_user_error(
                        TOOL,
                        f"{args.source} records no num_anchors, which DeepSpec's loader asserts: give "
                        "--num-anchors N (the anchors per sample it was trained with)",
                    )
                drafter.config.num_anchors = args.num_anchors
            if dspark and args.target is not None:
                export_deepspec(drafter, args.destination, target_dir=args.target)
            else:
                export_drafter(drafter, args.destination)
        else:
            verifier = verifier_of(args.source, args.target, args.verifier)
            export_speculators(drafter, args.destination, verifier=verifier, target_dir=args.target)
    except ValueError as exc:
        exit_for_user_error(TOOL, str(exc))
    report(args.destination, target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=TOOL, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate a drafter directory against the export contract")
    check.add_argument("directory", type=Path)
    check.add_argument("--target", type=Path, help="the target's checkpoint directory, for the pairing rules")
    conversion = commands.add_parser(
        "convert", help="write a drafter in another layout (z-lab / deepspec / speculators)"
    )
    conversion.add_argument("source", type=Path)
    conversion.add_argument("destination", type=Path)
    conversion.add_argument("--layout", choices=("speculators", "zlab", "deepspec"), required=True)
    conversion.add_argument("--target", type=Path, help="the target's checkpoint directory")
    conversion.add_argument("--verifier", help="the target's name in speculators_config (default: --target)")
    conversion.add_argument(
        "--num-anchors", type=int, help="deepspec: num_anchors of a DSpark drafter that does not record it"
    )
    args = parser.parse_args(argv)
    source = args.directory if args.command == "check" else args.source
    if not source.is_dir():
        exit_for_user_error(TOOL, f"{source}: no such directory")
    target = target_text_config(args.target) if args.target is not None else None
    if args.command == "check":
        report(args.directory, target)
    else:
        convert(args, target)


if __name__ == "__main__":
    main()
