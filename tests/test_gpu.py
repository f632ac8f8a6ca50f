"""CUDA runs of the reference trainer (run on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash.train import train

pytestmark = pytest.mark.gpu


def test_single_gpu_run_trains_in_bf16_and_decodes_losslessly(make_cfg):
    cfg = make_cfg(["gpu=single", "train.total_steps=20", "logger.every_steps=5"])
    summary = train(cfg)
    rows = [
        json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert summary["eval/lossless_frac"] == 1.0


def test_target_runs_in_bf16_and_drafter_keeps_fp32_master_weights(make_cfg):
    from dflash.build import build_run

    run = build_run(make_cfg(["gpu=single", "train.total_steps=2"]))
    assert run.target.embed_tokens.weight.dtype == torch.bfloat16
    assert next(run.trainer.step_fn.drafter.parameters()).dtype == torch.float32
    assert run.target.device.type == "cuda"
