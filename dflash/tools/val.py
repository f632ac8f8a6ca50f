"""A drafter's held-out figures on a run's validation split, without training: the val/loss,
val/acc, val/tau_sim, val/tau_block and val/tau_decode that `data.val_samples` reports, for any
drafter checkpoint.

    dflash val --ckpt DIR [--init-trained-on N] [hydra overrides of the run]

The overrides are the run's own (experiment, data.files, target, data.val_samples, seed): the
split is the one that run drew. A run started from another drafter's weights
(`drafter.init_from`) on data that extends what that drafter trained on draws its split from the
larger set, so most of its held-out samples are ones the initial drafter trained on, and its
val/ figures read high. `--init-trained-on N` keeps only the held-out samples that neither run
trained on: those past the first N samples, and those that the initial drafter's own run (on
the first N samples, with the same data.val_samples and seed) held out. N is that run's sample
count (dflash-prep's "training samples"); the first N samples must be the same in both (data
extended by appending records).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from dflash.config.devices import resolve_device_split
from dflash.data.schedule import held_out_ids
from dflash.distributed import visible_cuda_devices
from dflash.errors import exit_for_user_error
from dflash.export.zlab import load_drafter
from dflash.run.inputs import load_training_data, script_target
from dflash.run.launch import block_settings_of, plan_batches
from dflash.tools.compose import compose_typed
from dflash.trainer.validation import VAL_FIGURES, Validation


def unseen_by_init(val_ids: np.ndarray, *, trained_on: int, count: int, seed: int) -> np.ndarray:
    """The held-out ids that a run on the first `trained_on` samples did not train on: those
    past them, and those its own split (same count and seed) held out."""
    if trained_on <= count:
        raise SystemExit(f"--init-trained-on {trained_on}: must exceed data.val_samples={count}")
    earlier = set(held_out_ids(trained_on, count, seed).tolist())
    return np.array([i for i in val_ids.tolist() if i >= trained_on or i in earlier], dtype=val_ids.dtype)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ckpt", type=Path, required=True, help="a drafter directory (config.json + model.safetensors)"
    )
    parser.add_argument("--init-trained-on", type=int, default=None, metavar="N")
    args, overrides = parser.parse_known_args(argv)
    if not args.ckpt.is_dir():  # before the target and the data load (minutes for a real target)
        exit_for_user_error("dflash val", f"--ckpt {args.ckpt}: no such drafter directory")

    cfg = compose_typed(overrides)
    device = torch.device(resolve_device_split(cfg, visible_cuda_devices())[0][0])  # the first target device
    if device.type == "cpu":
        torch.set_num_threads(cfg.gpu.cpu_threads)
    target, _ = script_target(cfg, device, "dflash val")
    dataset, _ = load_training_data(cfg, target)
    planner, val_ids = plan_batches(cfg, dataset)
    if val_ids is None:
        raise SystemExit("data.val_samples=0: the run has no held-out split (set the run's data.val_samples)")
    split = f"{len(val_ids)} held-out samples of {len(dataset)}"
    if args.init_trained_on is not None:
        if args.init_trained_on > len(dataset):
            raise SystemExit(
                f"--init-trained-on {args.init_trained_on}: more samples than this data holds ({len(dataset)}); "
                "give the earlier run's sample count"
            )
        val_ids = unseen_by_init(
            val_ids, trained_on=args.init_trained_on, count=cfg.data.val_samples, seed=cfg.seed
        )
        split += f", {len(val_ids)} of them unseen by a run on the first {args.init_trained_on}"
        if len(val_ids) == 0:
            raise SystemExit(f"{split}: nothing left to measure")
    drafter = load_drafter(args.ckpt, device)
    settings = block_settings_of(cfg, device)  # the run's own: flex_attention and compiled loss on a GPU
    validation = Validation(
        dataset,
        val_ids,
        settings=settings,
        tokens_per_batch=cfg.data.tokens_per_batch,
        block_budget=planner.block_budget,
    )
    figures = validation.run(target, drafter)
    print(f"{args.ckpt}: {split}")
    for name in VAL_FIGURES:
        print(f"  val/{name:11s} {figures[f'val/{name}']:.3f}")
    return figures


if __name__ == "__main__":
    main()
