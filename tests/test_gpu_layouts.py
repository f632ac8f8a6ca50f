"""Every multi-GPU layout a user can ask for, against the run it must equal (GPU machines only).
Each names gpu.drafter too: left out, it takes every remaining GPU, and a bigger host than the
test needs would run a different layout.

Each test skips below the GPU count it needs. Tolerance: per-step losses within 1e-2 of the
reference layout's. Not bitwise: the target runs in bf16 and the drafter under bf16 autocast,
and attention backward accumulates with atomics, so two runs of the same layout already differ
in the last bits; a real bug (a replica training on stale features, a lost gradient, a rank
logging only its own batches, a wrong resume) moves the loss by far more.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.pipeline.replicas import weights_digest
from dflash.run.launch import build_run
from dflash.train import train
from tests.conftest import FAST

pytestmark = pytest.mark.gpu
LOSS_TOLERANCE = 1e-2
COMMON = ["pipeline=async", "train.total_steps=24", "logger.every_steps=1", "checkpoint.every_steps=8"]


def needs_gpus(count: int):
    return pytest.mark.skipif(
        torch.cuda.device_count() < count, reason=f"needs {count} GPUs, {torch.cuda.device_count()} visible"
    )


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def assert_same_curve(run_dir: Path, reference_dir: Path, steps: int = 24) -> None:
    mine, reference = losses(run_dir), losses(reference_dir)
    assert sorted(mine) == sorted(reference) == list(range(1, steps + 1))
    worst = max(abs(mine[s] - reference[s]) for s in reference)
    print(f"{run_dir.name} vs {reference_dir.name}: max |loss difference| {worst:.2e} over {steps} steps")
    assert worst < LOSS_TOLERANCE


def run_and_check_replicas(cfg) -> dict:
    """Train in-process; replicas (one per drafter device) must end bitwise identical."""
    run = build_run(cfg)
    summary = run.execute()
    digests = {weights_digest(step_fn.drafter) for step_fn in run.trainer.step_fns}
    assert digests == {summary["replica_digest"]}, digests
    return summary


def assert_split_matches_one_gpu(make_cfg, tmp_path: Path, split: list[str], replicas: int) -> dict:
    """`split` (a gpu=split layout) trains `replicas` bitwise-identical replicas along the curve
    of that many replicas on one GPU."""
    run_and_check_replicas(make_cfg(COMMON + ["gpu=single", f"gpu.drafter={replicas}"], tmp_path / "one_gpu"))
    summary = run_and_check_replicas(make_cfg(COMMON + ["gpu=split", *split], tmp_path / "split"))
    assert summary["replicas"] == replicas
    assert_same_curve(tmp_path / "split", tmp_path / "one_gpu")
    return summary


@needs_gpus(2)
def test_split_one_target_gpu_one_drafter_gpu_matches_one_gpu(make_cfg, tmp_path):
    train(make_cfg(COMMON + ["gpu=single"], tmp_path / "single"))
    run = build_run(make_cfg(COMMON + ["gpu=split", "gpu.target=1", "gpu.drafter=1"], tmp_path / "split"))
    assert run.trainer.target.device == torch.device("cuda:0")
    head = run.trainer.step_fns[0].head
    assert head.device == torch.device("cuda:1") and next(run.trainer.drafter.parameters()).is_cuda
    assert head.embed_tokens.weight.data_ptr() != run.trainer.target.embed_tokens.weight.data_ptr()
    summary = run.execute()
    assert_same_curve(tmp_path / "split", tmp_path / "single")
    # The final evaluation ran too (the drafter replica lives on another GPU than the target).
    assert summary["eval/num_prompts"] == 2 and summary["eval/tau"] >= 1.0 and summary["node_gpus"] >= 2
    assert 0.0 < summary["roles/target_busy_frac"] <= 1.0 and 0.0 < summary["roles/drafter_busy_frac"] <= 1.0


@needs_gpus(2)
def test_two_gpus_each_with_both_roles_match_two_replicas_on_one_gpu(make_cfg, tmp_path):
    """gpu=single gpu.target=2: 2 targets + 2 replicas, gradients summed across the GPUs in-process."""
    run_and_check_replicas(make_cfg(COMMON + ["gpu=single", "gpu.drafter=2"], tmp_path / "one_gpu"))
    summary = run_and_check_replicas(
        make_cfg(COMMON + ["gpu=single", "gpu.target=2", "gpu.drafter=2"], tmp_path / "two_gpus")
    )
    assert summary["replicas"] == 2
    assert_same_curve(tmp_path / "two_gpus", tmp_path / "one_gpu")


@needs_gpus(3)
def test_split_one_target_two_drafter_replicas_matches_two_replicas_on_one_gpu(make_cfg, tmp_path):
    assert_split_matches_one_gpu(make_cfg, tmp_path, ["gpu.target=1", "gpu.drafter=2"], replicas=2)


@needs_gpus(4)
def test_split_two_target_gpus_two_drafter_gpus_matches_two_replicas_on_one_gpu(make_cfg, tmp_path):
    assert_split_matches_one_gpu(make_cfg, tmp_path, ["gpu.target=2", "gpu.drafter=2"], replicas=2)


@needs_gpus(4)
def test_split_one_target_three_drafter_replicas_matches_three_replicas_on_one_gpu(make_cfg, tmp_path):
    """Three replicas fed by one target GPU."""
    assert_split_matches_one_gpu(make_cfg, tmp_path, ["gpu.target=1", "gpu.drafter=3"], replicas=3)


@needs_gpus(8)
def test_the_seed_layout_five_targets_three_drafters_matches_three_replicas_on_one_gpu(make_cfg, tmp_path):
    """`gpu=split gpu.target=5` on 8 GPUs: five target workers (GPUs 0-4) feed three replicas
    (GPUs 5-7)."""
    layout = ["gpu.target=5", "gpu.drafter=3"]
    run = build_run(make_cfg(COMMON + ["gpu=split", *layout], tmp_path / "layout"))
    assert [t.device.index for t in run.trainer.targets] == [0, 1, 2, 3, 4]
    assert [s.device.index for s in run.trainer.step_fns] == [5, 6, 7]
    run.trainer.monitor.close(True)  # built to see where the roles sit, not run
    del run
    assert_split_matches_one_gpu(make_cfg, tmp_path, layout, replicas=3)


def cli(args: list[str], run_dir: Path, launcher: list[str] | None = None) -> list[str]:
    return [sys.executable, *(launcher or []), "-m", "dflash.train", *args, f"hydra.run.dir={run_dir}"]


def assert_torchrun_matches_one_process(
    make_cfg, tmp_path: Path, data_cache: Path, layout: list[str], replicas: int
) -> dict:
    """torchrun, 2 processes on this host, each with `layout` over its share of the GPUs: the
    curve of `replicas` replicas in one process on one GPU, every rank agreeing on the weights."""
    run_and_check_replicas(
        make_cfg(COMMON + ["gpu=single", f"gpu.drafter={replicas}"], tmp_path / "one_process")
    )
    args = FAST + COMMON + [*layout, f"paths.cache_dir={data_cache}"]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        cli(args, tmp_path / "torchrun", launcher), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_curve(tmp_path / "torchrun", tmp_path / "one_process")
    summary = json.loads((tmp_path / "torchrun" / "summary.json").read_text())
    assert summary["replicas"] == replicas and summary["replica_digest"]  # every rank agreed, or it raised
    return summary


@needs_gpus(2)
def test_torchrun_two_ranks_on_nccl_match_two_replicas_in_one_process(make_cfg, tmp_path, data_cache):
    """The multi-node path on one host: one process per GPU (LOCAL_RANK picks it), gradients and
    metric windows summed over NCCL, rank 0 alone writes metrics and checkpoints."""
    assert_torchrun_matches_one_process(make_cfg, tmp_path, data_cache, ["gpu=single"], replicas=2)
    assert (tmp_path / "torchrun" / "checkpoints" / "last" / "model.safetensors").is_file()


@needs_gpus(2)
def test_split_run_stopped_by_sigterm_resumes_where_it_stopped(tmp_path, data_cache):
    args = FAST + [
        "pipeline=async",
        "gpu=split",
        "gpu.target=1",
        "gpu.drafter=1",
        "train.total_steps=200",
        "logger.every_steps=1",
        f"paths.cache_dir={data_cache}",
    ]
    proc = subprocess.Popen(
        cli(args, tmp_path / "stopped"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = tmp_path / "stopped" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    last = tmp_path / "stopped" / "checkpoints" / "last"
    stopped_at = torch.load(last / "trainer_state.pt", weights_only=True)["position"]["step"]
    assert 5 <= stopped_at < 200
    for name, extra in (("resumed", [f"resume={last.resolve()}"]), ("straight", [])):
        done = subprocess.run(cli(args + extra, tmp_path / name), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resumed, straight = losses(tmp_path / "resumed"), losses(tmp_path / "straight")
    assert sorted(resumed) == list(range(stopped_at + 1, 201))
    worst = max(abs(resumed[s] - straight[s]) for s in resumed)
    print(f"resumed at step {stopped_at}: max |loss difference| against the straight run {worst:.2e}")
    # Later steps drift further apart than the 24-step comparisons (atomics compound): a fresh
    # start instead of a resume would be off by whole units of loss.
    assert worst < 5 * LOSS_TOLERANCE


@needs_gpus(8)
def test_torchrun_two_processes_of_four_gpus_match_four_replicas_in_one_process(
    make_cfg, tmp_path, data_cache
):
    """The multi-node path at host scale: each process owns 4 GPUs and splits them 2 target + 2
    drafter; 4 replicas over NCCL train the curve of 4 replicas on one GPU."""
    layout = ["gpu=split", "gpu.target=2", "gpu.drafter=2"]
    assert_torchrun_matches_one_process(make_cfg, tmp_path, data_cache, layout, replicas=4)
