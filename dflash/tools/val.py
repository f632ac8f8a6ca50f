"""A drafter's held-out figures on a run's validation split, without training: the val/loss,
val/acc, val/tau_sim, val/tau_block and val/tau_decode that `data.val_samples` reports, for any
drafter checkpoint.

    dflash val ckpt=outputs/RUN/checkpoints/last data=conversations data.files=[chat.jsonl] data.val_samples=256
    dflash val ckpt=outputs/RUN/checkpoints/last --init-trained-on 20000 data.val_samples=256

`ckpt=DIR` names the drafter directory (config.json + model.safetensors), as for `dflash eval`;
`--ckpt DIR`, its older spelling, still works and is deprecated. The other overrides are the
run's own (experiment, data.files, target, data.val_samples, seed): the split is the one that
run drew. A run started from another drafter's weights (`drafter.init_from`) on data that
extends what that drafter trained on draws its split from the larger set, so most of its
held-out samples are ones the initial drafter trained on, and its val/ figures read high.
`--init-trained-on N` keeps only the held-out samples that neither run trained on: those past
the first N samples, and those that the initial drafter's own run (on the first N samples, with
the same data.val_samples and seed) held out. N is that run's sample count (`dflash prep`'s
"training samples"); the first N samples must be the same in both (data extended by appending
records).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.errors import exit_for_user_error
from dflash.tools.arguments import command_name, command_parser, composed_or_refused, flags_and_overrides

if TYPE_CHECKING:
    import numpy as np

    from dflash.config.schema import Config

TOOL = command_name("val")


def unseen_by_init(val_ids: np.ndarray, *, trained_on: int, count: int, seed: int) -> np.ndarray:
    """The held-out ids that a run on the first `trained_on` samples did not train on: those
    past them, and those its own split (same count and seed) held out."""
    if trained_on <= count:
        raise SystemExit(f"--init-trained-on {trained_on}: must exceed data.val_samples={count}")
    import numpy as np

    from dflash.data.scheduler import held_out_ids

    earlier = set(held_out_ids(trained_on, count, seed).tolist())
    return np.array([i for i in val_ids.tolist() if i >= trained_on or i in earlier], dtype=val_ids.dtype)


def parser() -> argparse.ArgumentParser:
    parser = command_parser("val", __doc__, usage="%(prog)s ckpt=DIR [--init-trained-on N] [OVERRIDE ...]")
    parser.add_argument(
        "--ckpt",
        type=Path,
        default=None,
        metavar="DIR",
        help="deprecated: write ckpt=DIR, the override `dflash eval` takes too",
    )
    parser.add_argument(
        "--init-trained-on",
        type=int,
        default=None,
        metavar="N",
        help="measure only the held-out samples a run on the first N samples did not train on",
    )
    return parser


def with_ckpt_override(ckpt_flag: Path | None, overrides: list[str]) -> list[str]:
    """The overrides, the deprecated `--ckpt DIR` turned into `ckpt=DIR`."""
    if ckpt_flag is None:
        return overrides
    given = [o for o in overrides if o.split("=", 1)[0].lstrip("+") == "ckpt"]
    if given:
        exit_for_user_error(TOOL, f"--ckpt {ckpt_flag} and {given[0]}: give the drafter once, as ckpt=DIR")
    return [*overrides, f"ckpt={ckpt_flag}"]


def read_command_line(argv: list[str] | None) -> tuple[argparse.Namespace, Config, Path]:
    """The flags, the run's config and the drafter directory, each checked: a mistake is one
    line and exit 2, before anything loads."""
    args, overrides = flags_and_overrides(parser(), argv)
    cfg = composed_or_refused("val", with_ckpt_override(args.ckpt, overrides))
    if not cfg.ckpt:
        exit_for_user_error(TOOL, "needs ckpt=DIR, a drafter directory (config.json + model.safetensors)")
    ckpt = Path(cfg.ckpt)
    given_as = f"--ckpt {ckpt}" if args.ckpt is not None else f"ckpt={ckpt}"
    if not ckpt.is_dir():  # before the target and the data load (minutes for a real target)
        exit_for_user_error(TOOL, f"{given_as}: no such drafter directory")
    if args.ckpt is not None:
        print(f"{TOOL}: note: --ckpt is deprecated; write ckpt={ckpt}", file=sys.stderr)
    return args, cfg, ckpt


def main(argv: list[str] | None = None) -> dict[str, float]:
    args, cfg, ckpt = read_command_line(argv)
    # Imported once the command line is read: --help and a refused argument load no torch.
    import torch

    from dflash.config.devices import resolve_device_split
    from dflash.distributed import visible_cuda_devices
    from dflash.export.zlab import load_drafter
    from dflash.run.inputs import load_training_data, script_target
    from dflash.run.launch import block_settings_of, plan_batches
    from dflash.trainer.validation import VAL_FIGURES, Validation

    device = torch.device(resolve_device_split(cfg, visible_cuda_devices())[0][0])  # the first target device
    if device.type == "cpu":
        torch.set_num_threads(cfg.gpu.cpu_threads)
    target, _ = script_target(cfg, device, TOOL)
    dataset, _ = load_training_data(cfg, target)
    planner, val_ids = plan_batches(cfg, dataset)
    if val_ids is None:
        exit_for_user_error(
            TOOL, "data.val_samples=0: the run has no held-out split (set the run's data.val_samples)"
        )
    split = f"{len(val_ids)} held-out samples of {len(dataset)}"
    if args.init_trained_on is not None:
        if args.init_trained_on > len(dataset):
            exit_for_user_error(
                TOOL,
                f"--init-trained-on {args.init_trained_on}: more samples than this data holds ({len(dataset)}); "
                "give the earlier run's sample count",
            )
        val_ids = unseen_by_init(
            val_ids, trained_on=args.init_trained_on, count=cfg.data.val_samples, seed=cfg.seed
        )
        split += f", {len(val_ids)} of them unseen by a run on the first {args.init_trained_on}"
        if len(val_ids) == 0:
            exit_for_user_error(TOOL, f"{split}: nothing left to measure")
    drafter = load_drafter(ckpt, device)
    settings = block_settings_of(cfg, device)  # the run's own: flex_attention and compiled loss on a GPU
    validation = Validation(
        dataset,
        val_ids,
        settings=settings,
        tokens_per_batch=cfg.data.tokens_per_batch,
        block_budget=planner.block_budget,
    )
    figures = validation.run(target, drafter)
    print(f"{ckpt}: {split}")
    for name in VAL_FIGURES:
        print(f"  val/{name:11s} {figures[f'val/{name}']:.3f}")
    return figures


if __name__ == "__main__":
    main()
