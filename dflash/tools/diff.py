"""`dflash diff A B [C ...]`: what differs between runs, for experiment reviews.

    dflash diff outputs/runA outputs/runB            # two runs
    dflash diff multirun/2026-11-29/11-16-24         # a sweep: each job against the sweep's common base
    dflash diff outputs/runA --defaults              # a run against the default config
    dflash diff A B --format markdown --all          # a table to paste; identical keys too

A run is a run dir (run.json, or .hydra/ + config_resolved.yaml), a sweep dir (its job dirs), or a
checkpoint dir (its config.yaml). Printed: group choices first (`scheduler: shuffle -> interleave`,
with the keys that choice changed under it), then changed / added / removed keys of the resolved
config, then final metrics side by side. Keys that never change results (output paths, W&B names)
are left out; `--ignore` adds patterns.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflash.errors import exit_for_user_error
from dflash.tools.arguments import command_name, command_parser

DEFAULT_IGNORE = (
    "paths.*",
    "hydra.*",
    "logger.sinks.wandb.name",
    "logger.sinks.wandb.group",
    "logger.sinks.wandb.tags",
    "resume",
)
METRICS = (
    "steps",
    "train/loss",
    "train/acc",
    "train/tau_sim",
    "train/tau_block",
    "train/tau_decode",
    "train/tau_prob",  # variant=dspark: from the target's probabilities
    "train/l1",
    "val/tau_sim",
    "val/tau_block",
    "val/tau_decode",
    "val/tau_prob",
    "eval/tau",
    "eval/lossless_frac",
    "wall_s",
)
MISSING = "<absent>"


@dataclass
class RunInfo:
    name: str
    config: dict[str, Any]  # flattened, dotted keys
    choices: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        flat: dict[str, Any] = {}
        for key, value in node.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat if flat or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def is_run_dir(path: Path) -> bool:
    return (path / "run.json").is_file() or (path / ".hydra" / "config.yaml").is_file()


def load_run(path: Path) -> RunInfo:
    if (path / "run.json").is_file():
        record = json.loads((path / "run.json").read_text())
        choices = {k: v for k, v in record.get("choices", {}).items() if not k.startswith("hydra")}
        metrics = record.get("metrics") or {}
        if record.get("status") == "FAILED":
            metrics = {**metrics, "status": f"FAILED ({record.get('error')})"}
        return RunInfo(path.name, flatten(record["config"]), choices, metrics)
    if (path / ".hydra" / "config.yaml").is_file():
        resolved = path / "config_resolved.yaml"
        config = yaml.safe_load(
            (resolved if resolved.is_file() else path / ".hydra" / "config.yaml").read_text()
        )
        hydra_cfg = (
            yaml.safe_load((path / ".hydra" / "hydra.yaml").read_text())
            if (path / ".hydra" / "hydra.yaml").is_file()
            else {}
        )
        choices = {
            k: v
            for k, v in hydra_cfg.get("hydra", {}).get("runtime", {}).get("choices", {}).items()
            if not k.startswith("hydra")
        }
        summary = path / "summary.json"
        return RunInfo(
            path.name, flatten(config), choices, json.loads(summary.read_text()) if summary.is_file() else {}
        )
    if (path / "config.yaml").is_file():  # a checkpoint directory carries its run's resolved config
        return RunInfo(path.name, flatten(yaml.safe_load((path / "config.yaml").read_text())))
    raise ValueError(f"{path} is not a run dir, a sweep dir or a checkpoint dir")


def expand(paths: list[Path]) -> list[Path]:
    runs = []
    for path in paths:
        if not path.is_dir():
            raise ValueError(f"{path}: no such run directory")
        if is_run_dir(path) or (path / "config.yaml").is_file():
            runs.append(path)
        else:
            jobs = sorted(
                (p for p in path.iterdir() if p.is_dir() and is_run_dir(p)),
                key=lambda p: (len(p.name), p.name),
            )
            if not jobs:
                raise ValueError(f"{path} holds no run (no run.json or .hydra/ in it or below)")
            runs += jobs
    return runs


def default_run() -> RunInfo:
    from omegaconf import OmegaConf, open_dict

    from dflash.tools.compose import compose_config

    cfg = compose_config(["paths.output_dir=."], return_hydra_config=True)
    choices = {
        k: v
        for k, v in OmegaConf.to_container(cfg.hydra.runtime.choices).items()
        if not k.startswith("hydra")
    }
    with open_dict(cfg):
        del cfg["hydra"]
    return RunInfo("defaults", flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)), choices)


def ignored(key: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(key, p) for p in patterns)


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return (
        MISSING if value is MISSING else json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    )


@dataclass
class Diff:
    names: list[str]
    choices: list[tuple[str, list[Any], list[tuple[str, list[Any]]]]]  # group, values, keys it changed
    keys: list[tuple[str, list[Any]]]
    metrics: list[tuple[str, list[Any]]]


def compute(runs: list[RunInfo], ignore: list[str], show_all: bool) -> Diff:
    def row(get, key):
        return [get(r).get(key, MISSING) for r in runs]

    def differs(values):
        return show_all or any(v != values[0] for v in values[1:])

    groups = sorted({k for r in runs for k in r.choices})
    changed_groups = [g for g in groups if differs(row(lambda r: r.choices, g))]
    keys = sorted({k for r in runs for k in r.config if not ignored(k, ignore)})
    key_rows = [(k, row(lambda r: r.config, k)) for k in keys if differs(row(lambda r: r.config, k))]
    choice_rows = []
    for group in changed_groups:
        # Keys inside the package of a group whose option changed are explained by that choice.
        inside = [(k, v) for k, v in key_rows if k.startswith(f"{group}.")]
        choice_rows.append((group, row(lambda r: r.choices, group), inside))
    folded = {k for _, _, inside in choice_rows for k, _ in inside}
    metric_keys = [m for m in METRICS if any(m in r.metrics for r in runs)] + sorted(
        {k for r in runs for k in r.metrics if k == "status"}
    )
    return Diff(
        [r.name for r in runs],
        choice_rows,
        [(k, v) for k, v in key_rows if k not in folded],
        [(m, row(lambda r: r.metrics, m)) for m in metric_keys],
    )


def describe(key: str, values: list[Any]) -> str:
    """`key: a -> b` for two runs (`added` / `removed` when one lacks it), `key: a | b | c` beyond."""
    if len(values) == 2 and MISSING in values:
        kind, value = ("added", values[1]) if values[0] is MISSING else ("removed", values[0])
        return f"{key}: {kind} ({fmt(value)})"
    return f"{key}: " + (" -> " if len(values) == 2 else " | ").join(map(fmt, values))


def render_text(diff: Diff) -> str:
    lines = ["runs: " + "  |  ".join(diff.names), "choices:" if diff.choices else "choices: (same)"]
    for group, values, inside in diff.choices:
        lines.append("  " + describe(group, values))
        lines += ["      " + describe(key, key_values) for key, key_values in inside]
    lines.append("config:" if diff.keys else "config: (same)")
    lines += ["  " + describe(key, values) for key, values in diff.keys]
    if diff.metrics:
        width = max(len(m) for m, _ in diff.metrics)
        lines.append("metrics:")
        lines.append("  " + " " * width + "  " + "  ".join(f"{n:>14}" for n in diff.names))
        for metric, values in diff.metrics:
            lines.append(f"  {metric:<{width}}  " + "  ".join(f"{fmt(v):>14}" for v in values))
    return "\n".join(lines)


def render_markdown(diff: Diff) -> str:
    header = "| | " + " | ".join(f"`{n}`" for n in diff.names) + " |"
    rule = "|---" * (len(diff.names) + 1) + "|"
    lines = [header, rule]
    for group, values, inside in diff.choices:
        lines.append(f"| **{group}** (choice) | " + " | ".join(fmt(v) for v in values) + " |")
        lines += [f"| &nbsp;&nbsp;{k} | " + " | ".join(fmt(v) for v in vals) + " |" for k, vals in inside]
    lines += [f"| {k} | " + " | ".join(fmt(v) for v in vals) + " |" for k, vals in diff.keys]
    lines += [f"| *{m}* | " + " | ".join(fmt(v) for v in vals) + " |" for m, vals in diff.metrics]
    return "\n".join(lines)


def sweep_deltas(runs: list[RunInfo], ignore: list[str], markdown: bool) -> str:
    """Each job against the sweep's common base (the values every job shares)."""
    diff = compute(runs, ignore, show_all=False)
    varying = [(g, v) for g, v, _ in diff.choices] + diff.keys
    lines = [f"{len(runs)} jobs; common base: everything but " + ", ".join(k for k, _ in varying)]
    for index, run in enumerate(runs):
        delta = ", ".join(f"{k}={fmt(values[index])}" for k, values in varying)
        metrics = ", ".join(
            f"{m}={fmt(values[index])}" for m, values in diff.metrics if values[index] is not MISSING
        )
        lines.append(
            f"- `{run.name}`: {delta}  ->  {metrics}" if markdown else f"  {run.name}: {delta}  ->  {metrics}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("diff", __doc__)
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--format", choices=("text", "markdown"), default="text")
    parser.add_argument("--all", action="store_true", help="also list keys that are identical")
    parser.add_argument("--defaults", action="store_true", help="compare against the default config")
    parser.add_argument("--ignore", action="append", default=[], help="fnmatch pattern of keys to leave out")
    args = parser.parse_args(argv)
    try:
        compare(args)
    except (ValueError, OSError) as exc:  # a missing or unreadable run: one line, exit 2
        exit_for_user_error(command_name("diff"), str(exc))


def compare(args: argparse.Namespace) -> None:
    ignore = list(DEFAULT_IGNORE) + args.ignore
    paths = expand(args.paths)
    runs = [load_run(p) for p in paths]
    if args.defaults:
        runs = [default_run(), *runs]
    markdown = args.format == "markdown"
    if len(args.paths) == 1 and len(runs) > 2 and not args.defaults:
        print(sweep_deltas(runs, ignore, markdown))
        return
    if len(runs) < 2:
        raise ValueError("give two runs, a sweep dir, or one run with --defaults")
    diff = compute(runs, ignore, args.all)
    print(render_markdown(diff) if markdown else render_text(diff))


if __name__ == "__main__":
    main()
