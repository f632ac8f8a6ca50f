"""`dflash val`: a checkpoint's held-out figures on its run's split, without training."""

from __future__ import annotations

import numpy as np
import pytest

from dflash.data.scheduler import held_out_ids
from dflash.tools import val
from dflash.train import train
from tests.conftest import FAST, compose_config


def test_the_figures_of_a_checkpoint_are_the_ones_its_run_reported(tmp_path, data_cache):
    overrides = FAST + ["data.val_samples=12", "train.total_steps=6", f"paths.cache_dir={data_cache}"]
    summary = train(compose_config(overrides, tmp_path / "run"))
    figures = val.main(["--ckpt", str(tmp_path / "run" / "checkpoints" / "last"), *overrides])
    for name, value in figures.items():
        assert value == pytest.approx(summary[name], rel=1e-4), name


def test_a_warm_started_split_keeps_only_what_neither_run_trained_on():
    earlier = set(held_out_ids(300, 40, seed=5).tolist())
    split = held_out_ids(400, 40, seed=5)  # the same data with 100 samples appended
    kept = val.unseen_by_init(split, trained_on=300, count=40, seed=5)
    trained_by_earlier = set(range(300)) - earlier  # what the first run's planner trained on
    assert set(kept.tolist()) == set(split.tolist()) - trained_by_earlier
    assert 0 < len(kept) < len(split)  # most of the larger split was trained on by the first run
    with pytest.raises(SystemExit, match="--init-trained-on 40: must exceed data.val_samples=40"):
        val.unseen_by_init(split, trained_on=40, count=40, seed=5)
    assert np.array_equal(kept, np.sort(kept))  # in the split's order
