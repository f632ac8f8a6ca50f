"""`dflash export check DIR [--target TARGET_DIR]`: does a drafter directory keep the export
contract every serving reader relies on (docs/EXPORT.md)? One line per problem on stderr and exit
2 on any; one `ok` line and exit 0 otherwise. Both layouts are checked: z-lab (what dflash
writes) and speculators.

    dflash export check outputs/run/checkpoints/last
    dflash export check outputs/run/checkpoints/last --target /models/Qwen3-8B   # + the pairing

`--target`: the target's checkpoint directory (its config.json; for an image-text checkpoint its
`text_config`): the drafter's num_target_layers, hidden size and mask id are checked against it.

A DSpark drafter (DeepSpec's layout, or speculators' `dspark`) is checked the same way; the
readers that refuse a well-formed one (a head type some engine does not build) are printed as
`note:` lines, exit 0. So is a DFlash2 drafter (the z-lab layout of z-lab's released DFlash2
checkpoints, or speculators' `dflash2`): its fields, convolution and selector tensors against
SGLang's, vLLM's, speculators' and llama.cpp's rules (llama.cpp's hidden-size limit refuses a z-lab
export; `note:` that SGLang reads the z-lab layout only). Whatever dflash's own loader refuses
(a Markov head type it cannot build, NaN or inf weights) fails the check too, and a checkpoint's
config.json must declare the block its run trained (its config.yaml).

`dflash export convert SRC DST --layout speculators|zlab|deepspec [--target TARGET_DIR]
[--verifier NAME] [--num-anchors N]`: the drafter of SRC (any layout) written to DST in the one
named, checked before it is reported done. zlab holds DFlash and DFlash2 drafters, deepspec
DSpark ones, speculators any (not a DFlash2 drafter that scales or caps its logits: that layout
has no field for it). speculators needs `--target`: the target's embedding and LM head are
bundled, as speculators' own save_pretrained writes them (its loader reads them from the drafter
directory); deepspec bundles them with `--target` (DeepSpec's own loader reads them there).
`--verifier` (default: --target's path) names the target in
`speculators_config.verifier`; `--num-anchors` gives a DSpark drafter read from the speculators
layout (which does not record it) the `num_anchors` DeepSpec's loader asserts.

    dflash export convert outputs/run/checkpoints/last drafter-speculators --layout speculators \
        --target /models/Qwen3-8B
    dflash export convert /drafters/from-speculators drafter-zlab --layout zlab
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.config.plugins import load_plugins_or_exit
from dflash.errors import exit_for_user_error

TOOL = "dflash export"  # the command users type: `dflash export check DIR`
# The registered layouts' names (dflash/export/export_registry.py; tests/test_variant_contract.py keeps
# the two equal), spelled here so that `--help` and a usage error import no torch.
LAYOUTS = ("speculators", "zlab", "deepspec")


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
    conversion.add_argument("--layout", choices=LAYOUTS, required=True)
    conversion.add_argument("--target", type=Path, help="the target's checkpoint directory")
    conversion.add_argument(
        "--verifier", help="the target's name in speculators_config (default: --target's path)"
    )
    conversion.add_argument(
        "--num-anchors", type=int, help="deepspec: num_anchors of a DSpark drafter that does not record it"
    )
    args = parser.parse_args(argv)
    load_plugins_or_exit(TOOL)  # before the directory is read: a plug-in's variant is known
    # The converters import torch: loaded once the arguments parse, so `--help` and a usage
    # error answer at once.
    from dflash.tools.export_commands import convert, refuse_another_target, report, target_text_config

    source = args.directory if args.command == "check" else args.source
    if not source.is_dir():
        exit_for_user_error(TOOL, f"{source}: no such directory")
    target = None
    if args.target is not None:
        target = target_text_config(args.target)
        refuse_another_target(source, args.target)
    if args.command == "check":
        report(args.directory, target)
    else:
        convert(args, target)


if __name__ == "__main__":
    main()
