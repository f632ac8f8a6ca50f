"""`dflash COMMAND ...` (and `python -m dflash`): the one front door to every dflash command.

Each command is the `main` of its module, called with the rest of the command line, so a command
reads the same arguments whether it is started as `dflash train ...` or by its older name
`dflash-train ...` (pyproject.toml's [project.scripts] keeps those names; tests/test_cli.py holds
the two lists to each other). Hydra commands take `key=value` overrides and `group=option`
choices; the others take flags (`dflash COMMAND --help` says which).

Plug-ins (dflash/config/plugins.py: a package's `dflash.plugins` entry points, DFLASH_PLUGINS)
are imported by each command that composes a config or reads a checkpoint, right before it does,
whichever name started it: `dflash COMMAND --help` stays immediate, and a plug-in that fails is
that command's one-line error.
"""

from __future__ import annotations

import importlib
import sys

from dflash import __version__

# name -> (module whose main() runs it, one line for `dflash --help`); the first eight also answer
# to their older names dflash-NAME. Imported only when chosen:
# `dflash --help` and `dflash --version` load no torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("dflash.train", "train a drafter (Hydra overrides; no overrides: the tiny CPU run)"),
    "eval": ("dflash.tools.eval", "decode prompts with a target and a drafter: tau, speedup, losslessness"),
    "regen": ("dflash.tools.regen", "the target rewrites the replies of conversation files (training data)"),
    "prep": ("dflash.tools.prep", "tokenize the training data a train run with the same overrides reads"),
    "export": (
        "dflash.tools.export",
        "check a drafter directory against the serving contract, or convert it",
    ),
    "report": ("dflash.tools.report", "plots and a one-page summary of a run (metrics.jsonl)"),
    "diff": ("dflash.tools.diff", "what differs between runs: config, versions, final metrics"),
    "schedule": (
        "dflash.tools.schedule",
        "bucket runs of the batch orders on your data, before any GPU time",
    ),
    "served": (
        "dflash.tools.served",
        "serve a drafter with llama.cpp beside dflash's own decoder: served tau, per-prompt agreement",
    ),
    "val": ("dflash.tools.val", "a checkpoint's held-out figures on its run's validation split"),
    "prompts": ("dflash.tools.prompts", "training prompts from text installed on this machine, for regen"),
    "demo": ("dflash.tools.demo", "a tiny target and conversation files to try the real-data commands on"),
    "completion": ("dflash.completion", 'shell completion: eval "$(dflash completion bash)"'),
}
HYDRA_COMMANDS = ("train", "eval", "regen", "prep", "served")


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: dflash COMMAND [ARGS ...]      dflash COMMAND --help: that command's arguments",
        "",
        "Train DFlash block-diffusion speculative-decoding drafters against a frozen target LLM.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()),
        "",
        f"{', '.join(HYDRA_COMMANDS)} take Hydra overrides (key=value, group=option); the others take flags.",
        "Plug-ins (a drafter variant of yours): DFLASH_PLUGINS=module,... or a dflash.plugins entry point.",
        "Start with docs/quickstart.md (your model on one GPU) and the README.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        raise SystemExit(0 if args else 2)
    if args[0] in ("-V", "--version"):
        print(f"dflash {__version__}")
        return
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"dflash: error: no command {name!r}{hint} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(COMMANDS[name][0])
    # Every command reads sys.argv (Hydra always does): the command's own line, under its name.
    sys.argv = [f"dflash {name}", *rest]
    module.main()


if __name__ == "__main__":
    main()
