"""The work of `dflash export` (dflash/tools/export.py parses its arguments): checking a drafter
directory against the export contract, and converting it to another layout."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from safetensors import SafetensorError

from dflash.config.schema import TargetConfig
from dflash.errors import USER_ERROR_EXIT, exit_for_user_error
from dflash.export.card import TrainingFacts, write_model_card
from dflash.export.contract import check_export, reader_limits, trained_block_problems
from dflash.export.export_registry import export_for, layout_named
from dflash.export.zlab import load_drafter, write_layout
from dflash.target.families import IMAGE_TEXT_TYPES
from dflash.target.target_identity import pairing_differences
from dflash.tools.export import TOOL
from dflash.trainer.checkpoint import RUN_CONFIG_FILE, STATE_FILE, load_trainer_state


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


def refuse_another_target(drafter_dir: Path, target_dir: Path) -> None:
    """The pairing rule dflash eval and resume apply (dflash/target/target_identity.py): a drafter that
    records its target (target.json, or a speculators verifier directory) is paired with that
    target only; a same-shape target with other weights or another tokenizer passes every shape
    rule and accepts about nothing."""
    differences = pairing_differences(drafter_dir, TargetConfig(name="export", path=str(target_dir)))
    if differences:
        exit_for_user_error(
            TOOL,
            f"{drafter_dir} was made for another target than --target {target_dir} "
            f"({', '.join(differences)}); pair it with the target it was trained on",
        )


def verifier_of(target: Path, name: str | None) -> dict[str, Any]:
    """speculators_config.verifier: the target's name (--verifier, else its path) and architectures."""
    architectures = json.loads((target / "config.json").read_text()).get("architectures") or []
    return {"name_or_path": name or str(target), "architectures": architectures}


def source_facts(source: Path, target: Path | None) -> TrainingFacts | None:
    """The training facts of a dflash checkpoint (its run's config.yaml and trainer state), for
    the converted directory's model card; None for a drafter trained elsewhere."""
    run_yaml = source / RUN_CONFIG_FILE
    if not run_yaml.is_file():
        return None
    run = yaml.safe_load(run_yaml.read_text()) or {}
    step = None
    if (source / STATE_FILE).is_file():
        step = load_trainer_state(source).get("position", {}).get("step")
    data = run.get("data") or {}
    files = ", ".join(data.get("files") or [])
    target_path = str(target) if target is not None else (run.get("target") or {}).get("path")
    return TrainingFacts(
        target=target_path or "its target",
        target_path=target_path,
        data=f"data={data.get('name')}" + (f": {files}" if files else ""),
        samples=None,  # not kept with a checkpoint; the source's README.md says it
        steps=step if step is not None else 0,
        seed=run.get("seed"),
    )


def report(directory: Path, target: dict[str, Any] | None) -> None:
    fail_on_problems(check_export(directory, target=target))
    print(f"ok: {directory} keeps the export contract (docs/EXPORT.md)")
    for limit in reader_limits(directory):
        print(f"note: {limit}")


def fail_on_problems(problems: list[str], shown_as: tuple[Path, Path] | None = None) -> None:
    """Each problem on its own line (a staged directory named by its destination), exit 2."""
    for problem in problems:
        if shown_as is not None:
            problem = problem.replace(str(shown_as[0]), str(shown_as[1]))
        print(f"{TOOL}: {problem}", file=sys.stderr)
    if problems:
        raise SystemExit(USER_ERROR_EXIT)


@contextmanager
def staged(destination: Path) -> Iterator[Path]:
    """A temporary directory beside `destination`, renamed onto it once the body succeeds: a
    convert interrupted (SIGTERM, Ctrl-C, a full disk) leaves no destination, never a config
    without weights. SIGTERM is turned into SystemExit here so the temporary is removed too."""
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        # A plain mkdir, not mkdtemp (0700): the directory renamed into place gets the mode a
        # checkpoint gets from the umask, so a server running as another user can read it.
        tmp = destination.parent / f".{destination.name}.tmp-{secrets.token_hex(8)}"
        tmp.mkdir()
    except OSError as exc:
        exit_for_user_error(TOOL, f"{destination}: cannot write there ({exc.strerror or exc})")

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield tmp
        if destination.exists():
            destination.rmdir()  # empty (checked before the write)
        os.replace(tmp, destination)
    except (OSError, SafetensorError) as exc:
        filename = getattr(exc, "filename", None)
        exit_for_user_error(
            TOOL,
            f"{destination}: writing {Path(filename).name if filename else 'it'} failed "
            f"({getattr(exc, 'strerror', None) or exc}); nothing was left there",
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def convert(args: argparse.Namespace, target: dict[str, Any] | None) -> None:
    if args.destination.exists() and (not args.destination.is_dir() or any(args.destination.iterdir())):
        exit_for_user_error(TOOL, f"{args.destination}: not empty; convert writes a new directory")
    try:
        drafter = load_drafter(args.source)
    except ValueError as exc:
        exit_for_user_error(TOOL, str(exc))
    layouts, layout = export_for(drafter).layouts, layout_named(args.layout)
    if args.layout not in layouts:
        exit_for_user_error(
            TOOL,
            f"{args.source}: a {drafter.display_name} drafter is not written in the {args.layout} layout: "
            f"--layout {' or '.join(layouts)}",
        )
    if layout.records_depth:
        complete_recorded_fields(args, drafter, target)
    if layout.tables_required and args.target is None:
        exit_for_user_error(TOOL, f"--layout {args.layout} needs --target DIR: {layout.tables_required}")
    fail_on_problems(trained_block_problems(args.source, drafter.config.block_size))
    verifier = verifier_of(args.target, args.verifier) if layout.tables_required else None
    with staged(args.destination) as tmp:
        try:
            write_layout(drafter, tmp, args.layout, target_dir=args.target, verifier=verifier)
            write_model_card(tmp, source_facts(args.source, args.target), served_from=str(args.destination))
        except ValueError as exc:
            exit_for_user_error(TOOL, str(exc))
        # Checked before it is renamed into place: a destination that exists keeps the contract.
        fail_on_problems(check_export(tmp, target=target), shown_as=(tmp, args.destination))
    print(f"ok: {args.destination} keeps the export contract (docs/EXPORT.md)")
    for limit in reader_limits(args.destination):
        print(f"note: {limit}")


def complete_recorded_fields(args: argparse.Namespace, drafter: Any, target: dict[str, Any] | None) -> None:
    """The fields a layout that records them needs and a source in another layout may lack:
    the target's depth (SGLang resolves layer ids by it), and `num_anchors` for a drafter whose
    readers assert it (`records_num_anchors`)."""
    if getattr(drafter.config, "num_target_layers", None) is None:
        # The speculators layout records no target depth.
        if target is None:
            exit_for_user_error(
                TOOL, f"{args.source} records no target depth (num_target_layers): give --target DIR"
            )
        drafter.config.num_target_layers = target["num_hidden_layers"]
    if drafter.records_num_anchors and getattr(drafter.config, "num_anchors", None) is None:
        if args.num_anchors is None:
            exit_for_user_error(
                TOOL,
                f"{args.source} records no num_anchors, which DeepSpec's loader asserts: give "
                "--num-anchors N (the anchors per sample it was trained with)",
            )
        drafter.config.num_anchors = args.num_anchors
