"""Nothing lost, nothing silently accepted: run-dir ownership, run records however a job ends,
one-line user errors, one metrics row per log window, the non-finite guard."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.tools.compose import compose_config
from tests.conftest import FAST, SLOW_MACHINE_TIMEOUT_S

CLI_TIMEOUT_S = SLOW_MACHINE_TIMEOUT_S


def cli(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "dflash.train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kwargs,
    )


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + CLI_TIMEOUT_S
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} never reached {count} lines (run exited: {proc.poll()})")


def test_a_second_run_into_a_live_run_dir_is_refused_and_the_first_is_untouched(tmp_path, data_cache):
    run_dir = tmp_path / "shared"
    common = FAST + [f"paths.cache_dir={data_cache}", f"hydra.run.dir={run_dir}", "logger.every_steps=1"]
    first = cli(common + ["train.total_steps=120", "loss.gamma=4"])
    wait_for_lines(run_dir / "metrics.jsonl", 3, first)
    hydra_config = (run_dir / ".hydra" / "config.yaml").read_text()
    second = cli(common + ["train.total_steps=10", "loss.gamma=7", "seed=1"])
    _, error = second.communicate(timeout=CLI_TIMEOUT_S)
    assert second.returncode == 2, error[-2000:]
    assert error.count("\n") == 1 and re.search(
        rf"run dir {run_dir} belongs to a run still alive \(pid {first.pid} on .*, started ", error
    )
    assert (run_dir / ".hydra" / "config.yaml").read_text() == hydra_config  # nothing overwritten
    output, error = first.communicate(timeout=CLI_TIMEOUT_S)
    assert first.returncode == 0, error[-2000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [s for s in steps if s <= 120]
    assert sorted(set(train_steps)) == list(range(1, 121))  # every step once: no second writer
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "COMPLETED" and record["config"]["loss"]["gamma"] == 4.0


def test_default_run_dirs_carry_microseconds_so_runs_in_one_second_do_not_collide():
    hydra = compose_config([], return_hydra_config=True).hydra
    assert re.fullmatch(r"outputs/\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}-\d{6}", hydra.run.dir)
    assert re.fullmatch(r"multirun/\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}-\d{6}", hydra.sweep.dir)


def test_sigterm_during_the_final_evaluation_says_so_and_keeps_what_it_has(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    args = FAST + [
        f"paths.cache_dir={data_cache}",
        f"hydra.run.dir={run_dir}",
        "train.total_steps=4",
        "checkpoint.every_steps=4",
        "eval.num_prompts=400",  # long enough to be caught in the middle
        "eval.max_new_tokens=32",
    ]
    proc = cli(args)
    final = run_dir / "checkpoints" / "step_0000004" / "model.safetensors"
    deadline = time.time() + CLI_TIMEOUT_S
    while time.time() < deadline and proc.poll() is None and not final.exists():
        time.sleep(0.05)
    time.sleep(2.0)  # training is over; the evaluation of 400 prompts has begun
    proc.send_signal(signal.SIGTERM)
    output, error = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM, error[-3000:]
    assert "stopped during the final evaluation after" in output + error
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval/interrupted"] is True and summary["steps"] == 4
    assert 0 < summary["eval/num_prompts"] < 400  # what was evaluated, kept
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "INTERRUPTED" and record["signal"] == "SIGTERM"
    assert record["metrics"]["eval/interrupted"] is True


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_sigterm_during_a_periodic_evaluation_abandons_it_and_checkpoints_at_once(
    tmp_path, data_cache, pipeline
):
    """A preempted job has seconds: the stop must not wait for an evaluation of 400 prompts."""
    run_dir = tmp_path / "run"
    args = FAST + [
        f"pipeline={pipeline}",
        f"paths.cache_dir={data_cache}",
        f"hydra.run.dir={run_dir}",
        "train.total_steps=200",
        "logger.every_steps=1",
        "eval.every_steps=2",
        "eval.periodic_num_prompts=400",  # minutes on these cores: caught in the middle
        "eval.max_new_tokens=32",
    ]
    proc = cli(args)
    wait_for_lines(run_dir / "metrics.jsonl", 2, proc)
    time.sleep(2.0)  # the step-2 snapshot's evaluation has begun
    proc.send_signal(signal.SIGTERM)
    output, error = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGTERM, error[-3000:]
    assert re.search(r"evaluation of the step \d+ snapshot abandoned: stop requested", output + error)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval/tau" in row for row in rows)  # a partial evaluation is not logged
    stopped_at = torch.load(run_dir / "checkpoints" / "last" / "trainer_state.pt", weights_only=True)
    assert 2 <= stopped_at["position"]["step"] < 200


def run_tool(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, env={**os.environ, **(env or {})}
    )


def test_user_errors_are_one_line_with_exit_code_2_and_the_traceback_is_kept(tmp_path):
    train_cli = [sys.executable, "-m", "dflash.train"]
    bad = run_tool([*train_cli, "drafter.mask_token_id=900", f"hydra.run.dir={tmp_path / 'bad'}"])
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0, bad.stderr  # one line, no traceback
    assert bad.stderr.startswith("dflash: error: drafter.mask_token_id=900 is outside the target's embedding")
    record = json.loads((tmp_path / "bad" / "run.json").read_text())
    assert record["status"] == "FAILED" and "Traceback" in record["traceback"]  # nothing lost
    full = run_tool(
        [*train_cli, "drafter.mask_token_id=900", f"hydra.run.dir={tmp_path / 'full'}"],
        env={"HYDRA_FULL_ERROR": "1"},
    )
    # HYDRA_FULL_ERROR=1 adds the traceback; a user error still exits 2 (the outcome scripts read).
    assert full.returncode == 2 and "Traceback" in full.stderr and "run/checks.py" in full.stderr
    assert full.stderr.strip().splitlines()[-1].startswith("dflash: error: drafter.mask_token_id=900")
    unwritable = run_tool([*train_cli, "hydra.run.dir=/proc/dflash-test"])
    assert unwritable.returncode == 2 and unwritable.stderr.strip().count("\n") == 0
    assert "cannot write the run dir /proc/dflash-test" in unwritable.stderr
    missing = run_tool([sys.executable, "-m", "dflash.tools.diff", str(tmp_path / "nowhere")])
    assert missing.returncode == 2
    assert missing.stderr == f"dflash-diff: error: {tmp_path / 'nowhere'}: no such run directory\n"
    no_report = run_tool([sys.executable, "-m", "dflash.tools.report", str(tmp_path / "nowhere")])
    assert no_report.returncode == 2 and no_report.stderr.startswith("dflash-report: error: ")
    assert no_report.stderr.count("\n") == 1


def test_an_empty_conversation_file_says_it_is_empty(make_cfg, tiny_chat_dir, tmp_path):
    from dflash.run.launch import build_run
    from tests.conftest import conversation_overrides

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="the files hold no conversation records"):
        build_run(make_cfg(conversation_overrides(tiny_chat_dir, [empty])))


def test_one_row_per_log_window_whatever_the_tick_cadence(make_cfg, tmp_path):
    """A monitor that ticks rarely (here: only at the end) must not merge windows: sync and
    async runs of one seed write the same train/ values at the same steps."""
    from dflash.train import train

    common = ["train.total_steps=20", "logger.every_steps=5", "monitor.interval_s=1e9"]
    rows = {}
    for pipeline in ("sync", "async"):
        train(make_cfg(common + [f"pipeline={pipeline}"], tmp_path / pipeline))
        lines = (tmp_path / pipeline / "metrics.jsonl").read_text().splitlines()
        rows[pipeline] = {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}
    assert sorted(rows["sync"]) == [5, 10, 15, 20]
    assert rows["sync"] == rows["async"]  # bitwise on CPU


def test_cadence_folds_the_steps_after_the_last_full_window_into_it():
    from dflash.pipeline.cadence import Cadence

    def closes(stop_after: int, log_every: int) -> list[int]:
        cadence = Cadence(stop_after=stop_after, log_every=log_every, checkpoint_every=1000)
        return [step for step in range(1, stop_after + 1) if cadence.logs_at(step)]

    assert closes(774, 10)[-3:] == [750, 760, 774]  # 761-774: 14 steps, never a 4-step window
    assert closes(20, 5) == [5, 10, 15, 20]
    assert closes(3, 5) == [3]  # a run shorter than the interval is one window


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_no_row_and_no_final_figure_comes_from_a_window_shorter_than_the_interval(
    make_cfg, tmp_path, pipeline
):
    from dflash.run.runner import format_summary
    from dflash.train import train

    summary = train(make_cfg([f"pipeline={pipeline}", "train.total_steps=14", "logger.every_steps=4"]))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    windows = [r for r in map(json.loads, lines) if "train/loss" in r]
    assert [(r["step"], r["train/window_steps"]) for r in windows] == [(4, 4.0), (8, 4.0), (14, 6.0)]
    last = windows[-1]
    for key in ("train/loss", "train/acc", "train/tau_sim", "train/tau_block", "train/tau_decode"):
        assert summary[key] == last[key], key
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["train/acc"] == last["train/acc"]
    text = format_summary(summary)
    assert f"-> {last['train/acc']:.3f}" in text and f"tau (simulated)   {last['train/tau_sim']:.3f}" in text


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_nan_loss_skips_its_update_and_stops_the_run_with_good_checkpoints(make_cfg, monkeypatch, pipeline):
    import torch
    from safetensors.torch import load_file

    from dflash.monitor.train_metrics import NonFiniteTraining
    from dflash.run.launch import build_run
    from dflash.step import step as step_module

    cfg = make_cfg(
        [f"pipeline={pipeline}", "train.total_steps=40", "checkpoint.every_steps=4", "logger.every_steps=1"]
    )
    run = build_run(cfg)
    real_loss, calls = step_module.draft_loss, []

    def nan_at_sixth_step(*args, **kwargs):
        stats = real_loss(*args, **kwargs)
        calls.append(1)
        if len(calls) == 6:
            stats.weighted_ce = stats.weighted_ce * float("nan")
        return stats

    monkeypatch.setattr(step_module, "draft_loss", nan_at_sixth_step)
    with pytest.raises(NonFiniteTraining, match="1 step\\(s\\) of the log window ending at step 6"):
        run.execute()
    drafter, optimizer = run.trainer.drafter, run.trainer.step_fn.optimizer
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    first = next(iter(drafter.parameters()))
    assert optimizer.state[first]["step"].item() == len(calls) - 1  # the NaN step did not count
    last = Path(cfg.paths.output_dir) / "checkpoints" / "last"
    assert all(torch.isfinite(t).all() for t in load_file(str(last / "model.safetensors")).values())


def test_a_resumed_runs_progress_bar_starts_where_it_left_off(make_cfg, tmp_path):
    from dflash.monitor.sinks import ProgressSink
    from dflash.run.launch import build_run
    from dflash.train import train

    first = make_cfg(["train.total_steps=8", "checkpoint.every_steps=4"], tmp_path / "first")
    train(first)
    checkpoint = Path(first.paths.output_dir) / "checkpoints" / "step_0000004"
    run = build_run(make_cfg(["train.total_steps=8", f"resume={checkpoint}"], tmp_path / "resumed"))
    try:
        bars = [s for s in run.trainer.monitor.sinks if isinstance(s, ProgressSink)]
        assert len(bars) == 1 and bars[0].bar.n == 4 and bars[0].bar.total == 8  # logger=jsonl has one
    finally:
        run.trainer.monitor.close(True)


def test_cpu_runs_use_the_configured_thread_count(make_cfg):
    import torch

    from dflash.run.launch import build_run

    run = build_run(make_cfg(["gpu.cpu_threads=2"]))
    try:
        assert torch.get_num_threads() == 2
    finally:
        run.trainer.monitor.close(True)
        torch.set_num_threads(1)


def test_debug_fast_shortens_training_and_the_evaluation(tmp_path, data_cache):
    from dflash.train import train
    from tests.conftest import compose_config as compose_test_config

    # Not through make_cfg: its FAST overrides would shorten the evaluation themselves.
    cfg = compose_test_config(["debug=fast", "data.num_samples=48"], tmp_path / "run", data_cache)
    summary = train(cfg)
    assert summary["steps"] == 6 and summary["eval/num_prompts"] == 2  # the default evaluates 16


def test_a_live_runs_paths_output_dir_is_refused_to_a_second_run(tmp_path, data_cache):
    """Two runs with their own Hydra dirs but one paths.output_dir: the second is refused (it
    would interleave metrics and overwrite checkpoints), naming the key and the holder."""
    from dflash.lock import RunDirLock

    shared = tmp_path / "shared"
    with RunDirLock(shared):  # a live run holding it (this process)
        second = cli(FAST + [f"paths.cache_dir={data_cache}", f"paths.output_dir={shared}", f"hydra.run.dir={tmp_path / 'own'}"])  # fmt: skip
        _, error = second.communicate(timeout=CLI_TIMEOUT_S)
    assert second.returncode == 2, error[-2000:]
    assert f"paths.output_dir: run dir {shared} belongs to a run still alive (pid {os.getpid()}" in error


def test_a_fresh_run_into_a_finished_runs_dir_is_refused_and_changes_nothing(tmp_path, make_cfg):
    from dflash.run.launch import build_run

    finished = tmp_path / "finished"
    (finished / "checkpoints" / "step_0000004").mkdir(parents=True)
    (finished / "checkpoints" / "last").symlink_to("step_0000004")
    (finished / "metrics.jsonl").write_text('{"step": 1}\n')
    expected = f"paths.output_dir={finished} holds an earlier run (metrics.jsonl): resume={finished / 'checkpoints' / 'last'} continues"  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(expected)):
        build_run(make_cfg(output_dir=finished))
    assert (finished / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_full_disk_while_checkpointing_names_the_path_and_leaves_no_temporary(tmp_path, monkeypatch):
    from dflash.trainer.checkpoint import save_checkpoint
    from tests.test_dflash_rules import tiny_drafter, tiny_target

    def no_space(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: file write failed")  # fmt: skip

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(OSError, match=r"writing checkpoint .*step_0000007 failed .*no earlier checkpoint"):
        save_checkpoint(tmp_path / "ckpt", 7, tiny_drafter(tiny_target()), {}, "a: 1\n", keep_last=2)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == []


def test_a_run_record_that_cannot_be_written_goes_to_stderr_and_leaves_no_temporary(
    tmp_path, monkeypatch, capsys
):
    import errno

    from dflash.run.record import write_record

    original = Path.write_text

    def full(self, *args, **kwargs):
        if self.name.endswith(".tmp"):
            original(self, "")  # the 0-byte file a full disk leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    write_record(
        tmp_path / "run.json",
        {"status": "FAILED", "error": "OSError: disk full", "traceback": "Traceback ..."},
    )
    err = capsys.readouterr().err
    assert (
        "cannot write the run record" in err
        and "status FAILED: OSError: disk full" in err
        and "Traceback" in err
    )
    assert list(tmp_path.iterdir()) == []
