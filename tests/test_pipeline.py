"""The asynchronous pipeline on CPU threads: equivalence with the sync oracle, data-parallel
replicas, the prefetcher's round-robin and stats, the queues, failures and shutdown."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash.data.dataset import TokenDataset
from dflash.data.scheduler import InterleavePlanner
from dflash.pipeline.prefetch import BatchPrefetcher
from dflash.pipeline.queues import HiddenStateQueue, OrderedQueue, QueueClosed
from dflash.run.launch import build_run
from dflash.run.runner import format_summary
from dflash.train import train
from dflash.trainer.async_trainer import FaultInjection
from tests.conftest import FAST, SLOW_MACHINE_TIMEOUT_S, compose_config


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("dflash-")]


# -- equivalence and replicas -----------------------------------------------------------------


def test_async_reproduces_sync_losses_bitwise(make_cfg, tmp_path):
    common = ["train.total_steps=12", "logger.every_steps=1", "checkpoint.every_steps=5"]
    train(make_cfg(common + ["pipeline=sync"], tmp_path / "sync"))
    train(make_cfg(common + ["pipeline=async"], tmp_path / "async"))
    sync, async_ = losses(tmp_path / "sync"), losses(tmp_path / "async")
    assert sorted(sync) == list(range(1, 13))
    assert sync == async_  # same seed, 1 target + 1 drafter: identical float for float
    assert pipeline_threads() == []


def test_replicas_stay_identical_and_every_drafter_reports(make_cfg, tmp_path):
    cfg = make_cfg(
        ["pipeline=async", "gpu.target=2", "gpu.drafter=2", "train.total_steps=8", "logger.every_steps=4"]
    )
    run = build_run(cfg)
    run.execute()
    replicas = [step_fn.drafter.state_dict() for step_fn in run.trainer.step_fns]
    assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
    start = build_run(make_cfg(["pipeline=async", "gpu.target=2", "gpu.drafter=2"], tmp_path / "fresh"))
    assert not torch.equal(start.trainer.drafter.fc.weight, run.trainer.drafter.fc.weight)  # it trained
    start.trainer.monitor.close(True)
    rows = [
        json.loads(line) for line in (Path(cfg.paths.output_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [4, 8]
    for row in train_rows:
        assert row["drafter0/opt_step"] == row["drafter1/opt_step"] == row["step"]
        assert math.isfinite(row["drafter0/loss"]) and math.isfinite(row["drafter1/loss"])
        assert sum(row[f"batch/bucket_{i}_pct"] for i in range(3)) == pytest.approx(100.0)
    assert pipeline_threads() == []


def test_several_target_workers_train_on_the_batches_of_one(make_cfg, tmp_path):
    """Three target workers finish out of order; the drafters still train step k on batches
    2k and 2k+1, exactly as with one target worker (two replicas: their sums commute, so the
    losses are equal float for float)."""
    common = ["pipeline=async", "gpu.drafter=2", "train.total_steps=10", "logger.every_steps=1"]
    train(make_cfg(common + ["gpu.target=1"], tmp_path / "one"))
    train(make_cfg(common + ["gpu.target=3"], tmp_path / "three"))
    assert losses(tmp_path / "three") == losses(tmp_path / "one") and len(losses(tmp_path / "one")) == 10


# -- prefetcher -------------------------------------------------------------------------------


def toy_dataset(n: int = 60, seed: int = 0) -> TokenDataset:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        length = int(rng.integers(10, 129))
        samples.append((rng.integers(0, 500, length).tolist(), [0] * 4 + [1] * (length - 4)))
    return TokenDataset.from_samples(samples)


def test_round_robin_gives_each_device_exactly_k_per_window_and_keeps_order():
    dataset = toy_dataset()
    planner = InterleavePlanner(
        lengths=dataset.lengths, bucket_edges=[48, 80, 128], tokens_per_batch=512, seed=0
    )
    devices = [torch.device("cpu")] * 3
    total = planner.batches_per_epoch(0)
    prefetcher = BatchPrefetcher(
        dataset=dataset,
        planner=planner,
        target_devices=devices,
        num_workers=3,
        depth_per_device=64,
        start_seq=0,
        end_seq=total,
    )
    threads = [threading.Thread(target=prefetcher.feed)] + [
        threading.Thread(target=prefetcher.work) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    received = [[] for _ in devices]
    for index, device_queue in enumerate(prefetcher.device_queues):
        while device_queue.qsize():
            received[index].append(device_queue.get().seq)
    # Device d gets seqs d, d+T, d+2T, ...: any window of k*T dispatches holds exactly k per device.
    assert received == [list(range(d, total, 3)) for d in range(3)]

    stats = prefetcher.get_batch_stats()
    plans = planner.epoch(0)
    lengths = [dataset.lengths[list(p.sample_ids)] for p in plans]
    assert stats["batch/dispatched"] == total
    for bucket in range(3):
        share = 100 * sum(p.bucket == bucket for p in plans) / total
        assert stats[f"batch/bucket_{bucket}_pct"] == pytest.approx(share)
    assert stats["batch/avg_seq_len"] == pytest.approx(np.concatenate(lengths).mean())
    assert stats["batch/max_seq_len"] == max(x.max() for x in lengths)
    assert stats["batch/batch_size"] == pytest.approx(np.mean([len(x) for x in lengths]))
    padded = sum(x.max() * len(x) for x in lengths)
    assert stats["batch/padding_efficiency"] == pytest.approx(sum(x.sum() for x in lengths) / padded)
    assert stats["batch/avg_total_tokens"] == pytest.approx(padded / total)
    assert 0 < stats["batch/bucket_entropy"] <= 1


# -- queues -----------------------------------------------------------------------------------


def test_hidden_state_queue_releases_in_dispatch_order_bounded_and_counts_buckets():
    q = HiddenStateQueue(capacity=3, num_buckets=2)
    for key, item, bucket in [(1, "b", 1), (2, "c", 1), (0, "a", 0)]:  # finished out of order
        q.put(key, item, bucket)
    assert q.qsize() == 3 and q.bucket_sizes() == [1, 2] and q.fill_ratio() == 1.0
    blocked = threading.Thread(target=q.put, args=(3, "d", 0))
    blocked.start()
    time.sleep(0.2)
    assert blocked.is_alive() and q.qsize() == 3  # the producer waits at the window's edge
    assert q.get() == "a"
    blocked.join(2)
    assert not blocked.is_alive()
    assert [q.get() for _ in range(3)] == ["b", "c", "d"] and q.bucket_sizes() == [0, 0]
    assert q.producer_wait_s > 0.1


def test_hidden_state_queue_holds_later_packets_until_the_next_one_arrives():
    q = HiddenStateQueue(capacity=2, num_buckets=1)
    q.put(1, "second", 0)  # a faster target worker's packet
    got = []
    consumer = threading.Thread(target=lambda: got.append(q.get()))
    consumer.start()
    time.sleep(0.2)
    assert consumer.is_alive() and got == []  # packet 0 is still being computed
    q.put(0, "first", 0)  # admitted even though a later key waits: no deadlock
    consumer.join(2)
    assert got == ["first"] and q.get() == "second"


@pytest.mark.parametrize("side", ["producer", "consumer"])
def test_close_wakes_a_blocked_thread_with_queue_closed(side):
    q = HiddenStateQueue(capacity=1, num_buckets=1)
    outcome = []
    if side == "producer":
        q.put(0, "x", 0)
    action = (lambda: q.put(1, "y", 0)) if side == "producer" else q.get

    def run():
        try:
            action()
            outcome.append("returned")
        except QueueClosed:
            outcome.append("closed")

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.1)
    q.close()
    thread.join(2)
    assert outcome == ["closed"] and not thread.is_alive()


def test_ordered_queue_releases_in_key_order_and_never_deadlocks():
    q = OrderedQueue(capacity=2)
    results = []
    putters = [threading.Thread(target=q.put, args=(key, f"item{key}")) for key in (3, 2, 1, 0)]
    for t in putters:
        t.start()
    consumer = threading.Thread(target=lambda: results.extend(q.get() for _ in range(4)))
    consumer.start()
    consumer.join(3)
    for t in putters:
        t.join(1)
    assert results == ["item0", "item1", "item2", "item3"]


# -- failures ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "faults,message",
    [
        (FaultInjection(target_at_batch=3), "injected target fault at batch 3"),
        (FaultInjection(drafter_at_step=4), "injected drafter fault at step 4"),
    ],
)
def test_a_failing_thread_stops_the_run_with_its_error(make_cfg, faults, message):
    cfg = make_cfg(["pipeline=async", "gpu.target=2", "gpu.drafter=2", "train.total_steps=50"])
    run = build_run(cfg, faults)
    with pytest.raises(RuntimeError, match=message) as info:
        run.execute()
    assert max(loop.step for loop in run.trainer.loops) < 50  # stopped at the fault, not after the run
    assert any("raised in pipeline thread" in note for note in getattr(info.value, "__notes__", []))
    # The original frames survive: the traceback reaches the line that raised in the worker.
    frames = [frame.name for frame in __import__("traceback").extract_tb(info.value.__traceback__)]
    assert "run" in frames
    assert pipeline_threads() == []


# -- resume and signals -----------------------------------------------------------------------


def test_async_resume_continues_bitwise(make_cfg, tmp_path):
    common = ["pipeline=async", "train.total_steps=12", "logger.every_steps=1", "checkpoint.every_steps=4"]
    train(make_cfg(common, tmp_path / "full"))
    checkpoint = tmp_path / "full" / "checkpoints" / "step_0000004"
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    assert state["position"] == {"next_seq": 4, "step": 4, "done_beyond": []}
    train(make_cfg(common + [f"resume={checkpoint}"], tmp_path / "resumed"))
    full, resumed = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(5, 13))
    assert all(resumed[s] == full[s] for s in resumed)


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_resume_finishes_identically(tmp_path, data_cache):
    args = FAST + [
        "pipeline=async",
        "train.total_steps=300",
        "logger.every_steps=1",
        f"paths.cache_dir={data_cache}",
    ]
    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.train", *args, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + SLOW_MACHINE_TIMEOUT_S
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=SLOW_MACHINE_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM, output[-2000:]
    last = run_dir / "checkpoints" / "last"
    stopped_at = torch.load(last / "trainer_state.pt", weights_only=True)["position"]["step"]
    assert 5 <= stopped_at < 300
    record = json.loads((run_dir / "run.json").read_text())  # every job has its record
    assert record["status"] == "INTERRUPTED" and record["signal"] == "SIGTERM"

    resumed_summary = train(
        compose_config(args + [f"resume={last.resolve()}"], tmp_path / "resumed", data_cache)
    )
    straight_summary = train(compose_config(args, tmp_path / "straight", data_cache))
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert min(resumed) == stopped_at + 1 and max(resumed) == 300
    assert all(resumed[s] == straight[s] for s in resumed)
    # The resumed process's summary says its first window and time start at the resume, not at step 0.
    assert resumed_summary["resumed_from_step"] == stopped_at and "resumed_from_step" not in straight_summary
    assert resumed_summary["train/loss_first_window"] == resumed[stopped_at + 1]  # logger.every_steps=1
    printed = format_summary(resumed_summary)
    assert f"300  (resumed at step {stopped_at}: " in printed
    assert f"(from the first window after step {stopped_at})" in printed
    assert "resumed" not in format_summary(straight_summary)


@pytest.mark.slow
def test_two_processes_on_gloo_equal_two_replicas_in_one_process(tmp_path, data_cache):
    """torchrun, 2 ranks x 1 drafter, gradients all-reduced on gloo == 1 process x 2 drafters:
    the same final weights, and rank 0 logs the loss of the whole job (both ranks' batches)."""
    args = FAST + [
        "pipeline=async",
        "train.total_steps=6",
        "logger.every_steps=1",
        "eval.num_prompts=1",
        f"paths.cache_dir={data_cache}",
    ]
    # torchrun gives each rank one intra-op thread; the single process gets the same, so both
    # sum in the same order and the comparison can be bitwise.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for launcher, extra, out in [
        (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"], [], "ddp"),
        ([], ["gpu.drafter=2"], "local"),
    ]:
        result = subprocess.run(
            [
                sys.executable,
                *launcher,
                "-m",
                "dflash.train",
                *args,
                *extra,
                f"hydra.run.dir={tmp_path / out}",
            ],
            capture_output=True,
            text=True,
            timeout=SLOW_MACHINE_TIMEOUT_S,
            env=env,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ddp = load_file(str(tmp_path / "ddp" / "checkpoints" / "last" / "model.safetensors"))
    local = load_file(str(tmp_path / "local" / "checkpoints" / "last" / "model.safetensors"))
    assert ddp.keys() == local.keys()
    assert all(torch.equal(ddp[k], local[k]) for k in ddp)
    # Same sums, added in float32 by the all-reduce across processes and in float64 by the
    # monitor within one: equal to float32 rounding. (Rank 0 logging its own share fails this.)
    ddp_losses, local_losses = losses(tmp_path / "ddp"), losses(tmp_path / "local")
    assert ddp_losses.keys() == local_losses.keys() and len(local_losses) == 6
    assert all(math.isclose(ddp_losses[s], local_losses[s], rel_tol=1e-6) for s in local_losses)
    ddp_summary, local_summary = (
        json.loads((tmp_path / d / "summary.json").read_text()) for d in ("ddp", "local")
    )
    assert ddp_summary["replicas"] == local_summary["replicas"] == 2
    assert ddp_summary["replica_digest"] == local_summary["replica_digest"]
    assert pipeline_threads() == []
