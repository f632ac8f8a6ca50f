"""Nothing lost, nothing silently accepted: run-dir ownership (a refusal never touches the run it
refuses), run records however a job ends (repeated signals too), atomic exports, a resume that
says what changed in its data, size checks before loading, `~` and HOME in paths, one-line user
errors, one metrics row per log window, the non-finite guard."""

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


def test_default_run_dirs_carry_microseconds_and_the_pid_so_runs_launched_together_do_not_collide():
    hydra = compose_config([], return_hydra_config=True).hydra
    pid = os.getpid()
    assert re.fullmatch(
        rf"outputs/\d{{4}}-\d{{2}}-\d{{2}}/\d{{2}}-\d{{2}}-\d{{2}}-\d{{6}}-{pid}", hydra.run.dir
    )
    assert re.fullmatch(
        rf"multirun/\d{{4}}-\d{{2}}-\d{{2}}/\d{{2}}-\d{{2}}-\d{{2}}-\d{{6}}-{pid}", hydra.sweep.dir
    )


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
    assert bad.stderr.startswith(
        "dflash train: error: drafter.mask_token_id=900 is outside the target's embedding"
    )
    record = json.loads((tmp_path / "bad" / "run.json").read_text())
    assert record["status"] == "FAILED" and "Traceback" in record["traceback"]  # nothing lost
    full = run_tool(
        [*train_cli, "drafter.mask_token_id=900", f"hydra.run.dir={tmp_path / 'full'}"],
        env={"HYDRA_FULL_ERROR": "1"},
    )
    # HYDRA_FULL_ERROR=1 adds the traceback; a user error still exits 2 (the outcome scripts read).
    assert full.returncode == 2 and "Traceback" in full.stderr and "run/checks.py" in full.stderr
    assert full.stderr.strip().splitlines()[-1].startswith("dflash train: error: drafter.mask_token_id=900")
    unwritable = run_tool([*train_cli, "hydra.run.dir=/proc/dflash-test"])
    assert unwritable.returncode == 2 and unwritable.stderr.strip().count("\n") == 0
    assert "cannot write the run dir /proc/dflash-test" in unwritable.stderr
    missing = run_tool([sys.executable, "-m", "dflash.tools.diff", str(tmp_path / "nowhere")])
    assert missing.returncode == 2
    assert missing.stderr == f"dflash diff: error: {tmp_path / 'nowhere'}: no such run directory\n"
    no_report = run_tool([sys.executable, "-m", "dflash.tools.report", str(tmp_path / "nowhere")])
    assert no_report.returncode == 2 and no_report.stderr.startswith("dflash report: error: ")
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


def test_the_summary_never_prints_nan_and_says_why_a_figure_is_absent():
    """A short DFlash2 run whose selector changed no pick has no share of changed picks that were
    right (0 / 0): the summary leaves it out; other undefined ratios (DSpark's, the held-out
    split's) read `n/a (why)`."""
    from dflash.run.runner import format_summary

    nan = float("nan")
    base = {
        "run_dir": "r",
        "checkpoint": "c",
        "steps": 6,
        "wall_s": 1.3,
        "pipeline": "sync",
        **{f"train/{k}": 1.0 for k in ("loss", "loss_first_window", "acc", "acc_first_window", "tau_sim")},
        "train/tau_block": 1.001,
        "train/tau_decode": 1.0,
        "val_samples": 4,
        **{f"val/{k}": 1.0 for k in ("tau_sim", "tau_block")},
        "val/tau_decode": nan,
        "eval/tau": 1.0,
        "eval/num_prompts": 2.0,
    }
    dflash2 = {
        **base,
        **{f"train/{k}": 0.5 for k in ("ce", "selector_ce", "candidate_recall", "candidate_mass")},
        "train/selector_changed": 0.0,
        "train/selector_changed_correct": nan,
        "train/unary_tau_decode": 1.0,
        "train/oracle_tau_decode": 1.016,
    }
    text = format_summary(dflash2)
    assert "nan" not in text
    assert "selector changed 0.000 of picks; tau_decode unary 1.000, oracle 1.016" in text
    assert "1.000 (1.000, n/a (no block measured)) on 4 held-out samples" in text
    dspark = {**base, "train/ce": 0.5, "train/l1": nan, "train/confidence_loss": 0.1}
    dspark |= {"train/confidence_abs_error": 0.2, "train/tau_prob": nan}
    text = format_summary(dspark)
    assert "nan" not in text
    assert "l1 n/a (not finite)" in text and "probabilities n/a (no block measured)" in text


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_nan_loss_skips_its_update_and_stops_the_run_with_good_checkpoints(make_cfg, monkeypatch, pipeline):
    import torch
    from safetensors.torch import load_file

    from dflash.monitor.train_metrics import NonFiniteTraining
    from dflash.run.launch import build_run
    from dflash.step import variant as variant_module  # DFlashVariant.block_loss calls draft_loss

    cfg = make_cfg(
        [f"pipeline={pipeline}", "train.total_steps=40", "checkpoint.every_steps=4", "logger.every_steps=1"]
    )
    run = build_run(cfg)
    real_loss, calls = variant_module.draft_loss, []

    def nan_at_sixth_step(*args, **kwargs):
        stats = real_loss(*args, **kwargs)
        calls.append(1)
        if len(calls) == 6:
            stats.weighted_ce = stats.weighted_ce * float("nan")
        return stats

    monkeypatch.setattr(variant_module, "draft_loss", nan_at_sixth_step)
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


def test_a_run_stopped_before_its_first_step_is_started_again_in_its_dir(tmp_path, make_cfg):
    """An attempt stopped while its first step compiled leaves only step-0 monitor rows (the last
    one cut by the kill) and no checkpoint: the same command again starts the run there instead
    of asking for a checkpoint that does not exist; the old rows move aside, kept. One row of a
    trained step makes it an earlier run again, refused."""
    from dflash.run.ownership import UNTRAINED_METRICS
    from dflash.run.preflight import check_before_loading

    attempt = tmp_path / "attempt"
    attempt.mkdir()
    old_rows = '{"step": 0, "queue/hs_depth": 10}\n{"step": 0, "queue/hs_depth": 10}\n{"step": 0, "queue/h'
    (attempt / "metrics.jsonl").write_text(old_rows)
    check_before_loading(make_cfg(output_dir=attempt))
    assert (attempt / UNTRAINED_METRICS).read_text() == old_rows
    assert not (attempt / "metrics.jsonl").exists()
    (attempt / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "train/loss": 6.2}\n')
    with pytest.raises(
        ValueError, match=r"holds an earlier run \(metrics.jsonl\): resume=<one of its checkpoints>"
    ):
        check_before_loading(make_cfg(output_dir=attempt))
    assert (attempt / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1, "train/loss": 6.2}\n'


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


def finished_run(run_dir: Path) -> dict[str, str]:
    """A finished run's files as they lie on disk: its record, its Hydra config, its metrics."""
    files = {
        "run.json": json.dumps({"status": "COMPLETED"}),
        ".hydra/config.yaml": "seed: 0\n",
        ".hydra/overrides.yaml": "- seed=0\n",
        "train.log": "first run\n",
        "metrics.jsonl": '{"step": 1}\n',
        "summary.json": '{"steps": 1}',
    }
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    return files


@pytest.mark.parametrize(
    "tool", ["dflash.train", "dflash.tools.eval", "dflash.tools.regen", "dflash.tools.prep"]
)
def test_a_refused_run_leaves_the_finished_run_it_refused_untouched(tmp_path, tool):
    """Refused before Hydra writes `.hydra/` or train.log, and before any record: run.json stays
    the first run's COMPLETED one (a resume of that run is still offered). Every tool that
    writes a run record into its Hydra dir refuses a training run's directory the same way."""
    run_dir = tmp_path / "run"
    files = finished_run(run_dir)
    second = run_tool([sys.executable, "-m", tool, f"hydra.run.dir={run_dir}"])
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert f"hydra.run.dir={run_dir} holds an earlier run (summary.json, metrics.jsonl)" in second.stderr
    assert {name: (run_dir / name).read_text() for name in files} == files
    assert not (run_dir / "config_resolved.yaml").exists()


def test_a_sweep_into_a_finished_sweeps_dir_is_refused_before_it_writes(tmp_path):
    (tmp_path / "multirun.yaml").write_text("first sweep\n")
    job = tmp_path / "0"
    files = finished_run(job)
    sweep = run_tool([sys.executable, "-m", "dflash.train", "-m", "seed=1,2", f"hydra.sweep.dir={tmp_path}"])
    assert sweep.returncode == 2 and f"hydra.sweep.dir={tmp_path} holds an earlier sweep" in sweep.stderr
    assert (tmp_path / "multirun.yaml").read_text() == "first sweep\n"
    assert {name: (job / name).read_text() for name in files} == files


@pytest.mark.parametrize("fault", ["sigterm", "full_disk"])
def test_an_interrupted_or_failed_convert_leaves_no_destination(tmp_path, capsys, monkeypatch, fault):
    """convert writes beside the destination and renames: SIGTERM or a full disk between the
    config and the weights leaves neither a half directory nor a temporary (a rerun is not
    refused as "not empty")."""
    import errno

    from dflash.export import zlab
    from tests.test_speculators import export_cli, tiny_drafter

    zlab.export_drafter(tiny_drafter(), tmp_path / "source")
    real_save = zlab.save_file

    def fail_after_the_config(state, filename, **kwargs):
        assert Path(filename).with_name("config.json").is_file()
        if fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        real_save(state, filename, **kwargs)  # a part of the weights lands first
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(zlab, "save_file", fail_after_the_config)
    code, err = export_cli(
        capsys, "convert", str(tmp_path / "source"), str(tmp_path / "dst"), "--layout", "zlab"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
    if fault == "sigterm":
        assert code == 128 + signal.SIGTERM
    else:
        assert code == 2 and err == (
            f"dflash export: error: {tmp_path / 'dst'}: writing model.safetensors failed "
            "(No space left on device); nothing was left there\n"
        )
    monkeypatch.setattr(zlab, "save_file", real_save)
    code, err = export_cli(
        capsys, "convert", str(tmp_path / "source"), str(tmp_path / "dst"), "--layout", "zlab"
    )
    assert code == 0, err


def test_convert_into_an_unwritable_place_is_one_line_naming_it(tmp_path, capsys):
    from dflash.export.zlab import export_drafter
    from tests.test_speculators import export_cli, tiny_drafter

    export_drafter(tiny_drafter(), tmp_path / "source")
    code, err = export_cli(
        capsys, "convert", str(tmp_path / "source"), "/proc/dflash-test/dst", "--layout", "zlab"
    )
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("dflash export: error: /proc/dflash-test/dst: cannot write there (")


def test_signals_in_quick_succession_never_break_off_the_checkpoint_or_the_record(tmp_path, data_cache):
    """Ctrl-C, then Ctrl-C and SIGTERM every 50 ms until it exits (an impatient user, a
    scheduler): the first stops the run; the others land in the checkpoint or the record
    writing and are only noted. The run exits 128 + the first signal with its record written."""
    run_dir = tmp_path / "run"
    args = FAST + [f"paths.cache_dir={data_cache}", f"hydra.run.dir={run_dir}", "train.total_steps=400"]
    proc = cli(args + ["logger.every_steps=1"])
    wait_for_lines(run_dir / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGINT)
    for repeat in range(200):  # until it has exited: every stage of the wind-down gets some
        time.sleep(0.05)
        if proc.poll() is not None:
            break
        proc.send_signal(signal.SIGTERM if repeat % 2 else signal.SIGINT)
    _, error = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 128 + signal.SIGINT, error[-3000:]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "INTERRUPTED" and record["signal"] == "SIGINT"
    state = torch.load(run_dir / "checkpoints" / "last" / "trainer_state.pt", weights_only=True)
    assert 3 <= state["position"]["step"] < 400


def copy_with_config(source: Path, destination: Path, **changes) -> Path:
    """`source`'s checkpoint with its config.json edited (None removes a key); weights linked."""
    destination.mkdir()
    for file in source.iterdir():
        if file.name != "config.json":
            (destination / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (destination / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return destination


def test_an_image_text_config_without_text_config_is_refused_before_loading(tmp_path, tiny_qwen3_5_dir):
    """transformers would build its default 9B language model (22 GB) and be killed for memory."""
    from dflash.config.schema import TargetConfig
    from dflash.target.model import load_target_config

    directory = copy_with_config(tiny_qwen3_5_dir, tmp_path / "no_text_config", text_config=None)
    with pytest.raises(ValueError, match=r"config.json \(model_type 'qwen3_5'\) has no text_config"):
        load_target_config(TargetConfig(name="hf", path=str(directory)))


def test_a_config_describing_more_than_the_weights_hold_is_refused_before_loading(tmp_path, tiny_qwen3_dir):
    from dflash.config.schema import TargetConfig
    from dflash.target.model import FrozenTarget

    directory = copy_with_config(tiny_qwen3_dir, tmp_path / "wider", intermediate_size=8192)
    with pytest.raises(ValueError, match=r"describes a language model of [\d.]+M parameters, but its weight"):
        FrozenTarget.from_config(TargetConfig(name="hf", path=str(directory)), [1, 3], torch.device("cpu"))


def test_a_resume_says_what_changed_in_its_data_and_refuses_unless_accepted_by_name(
    make_cfg, tmp_path, tiny_chat_dir, tiny_conversations
):
    """A checkpoint records what it trained on (data.json); a resume onto appended, edited or
    re-templated data would continue its schedule position on another sample set: refused,
    saying what changed. Appended data gets the documented route (drafter.init_from); a moved
    file with the same content is the same data; resume_changed_data=true accepts."""
    from dflash.run.launch import build_run
    from dflash.train import train
    from tests.conftest import conversation_overrides

    lines = tiny_conversations.read_text().splitlines(keepends=True)
    original = tmp_path / "chat.jsonl"
    original.write_text("".join(lines))
    first = make_cfg(
        conversation_overrides(tiny_chat_dir, [original]) + ["train.total_steps=4"], tmp_path / "a"
    )
    train(first)
    checkpoint = tmp_path / "a" / "checkpoints" / "step_0000004"
    recorded = json.loads((checkpoint / "data.json").read_text())
    assert recorded["files"] == [{"path": str(original), "sha256": recorded["files"][0]["sha256"]}]
    assert recorded["samples"] > 0 and recorded["template"]

    def resume(files: list[Path], *extra: str):
        overrides = conversation_overrides(tiny_chat_dir, files) + [
            "train.total_steps=8",
            f"resume={checkpoint}",
        ]
        return build_run(
            make_cfg(overrides + list(extra), tmp_path / f"resumed{len(list(tmp_path.iterdir()))}")
        )

    grown = tmp_path / "grown.jsonl"
    grown.write_text("".join(lines + lines[:6]))
    with pytest.raises(ValueError, match=r"data grew by appending: \d+ -> \d+ samples.*drafter.init_from="):
        resume([grown])
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(lines[1:]))
    with pytest.raises(
        ValueError, match=rf"{edited} is new or changed; data.files: {original} \(as trained on\)"
    ):
        resume([edited])
    moved = tmp_path / "moved.jsonl"
    moved.write_text(original.read_text())
    for accepted in (resume([moved]), resume([grown], "resume_changed_data=true")):
        assert accepted.trainer.position.step == 4
        accepted.trainer.monitor.close(True)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_signal_after_the_last_step_ends_the_run_as_a_completed_one(
    make_cfg, tmp_path, monkeypatch, pipeline
):
    """SIGTERM once the last step is done (a time limit at the very end): the run still stops at
    once, but training is complete, so it ends as one: the held-out split measured, the final
    evaluation stopped before its first prompt, summary.json written (a rerun sees a finished run
    rather than a checkpoint with nothing left to train). A signal well before the end still
    ends the run early, with no summary."""
    from dflash.train import train
    from dflash.trainer.lifecycle import Trainer
    from dflash.trainer.signals import StopRequested

    def signal_at(step: int):
        stepped = Trainer._stepped

        def signalled(self, at):
            stepped(self, at)
            if at == step:
                os.kill(os.getpid(), signal.SIGTERM)

        monkeypatch.setattr(Trainer, "_stepped", signalled)

    settings = [f"pipeline={pipeline}", "train.total_steps=4", "data.val_samples=4"]
    signal_at(4)
    with pytest.raises(StopRequested):
        train(make_cfg(settings, tmp_path / "last"))
    summary = json.loads((tmp_path / "last" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval/interrupted"] is True
    assert "val/tau_decode" in summary and "eval/tau" not in summary
    stopped = torch.load(tmp_path / "last" / "checkpoints" / "last" / "trainer_state.pt", weights_only=True)
    assert stopped["position"]["step"] == 4
    signal_at(2)  # of 8: the asynchronous drafters finish the step they are in, far from the end
    with pytest.raises(StopRequested):
        train(make_cfg([*settings, "train.total_steps=8"], tmp_path / "early"))
    assert not (tmp_path / "early" / "summary.json").exists()


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_a_compile_broken_off_by_the_stop_signal_stops_the_run_at_its_last_step(
    make_cfg, tmp_path, monkeypatch, caplog, pipeline
):
    """`timeout` and Ctrl-C signal the whole process group: the compilers' own processes (g++,
    Inductor's workers) die and the step being compiled fails with a compile error (seen on
    CPU with four compile threads). The run stops as the signal asked, with the checkpoint of
    the steps it finished; the same error without a stop request still ends the run with it."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError

    from dflash.step import variant as variant_module  # DFlashVariant.block_loss calls draft_loss
    from dflash.train import train
    from dflash.trainer import signals
    from dflash.trainer.signals import StopRequested

    real_loss = variant_module.draft_loss

    def compile_killed_at_third_step(signalled: bool):
        calls = []

        def loss(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                if signalled:
                    os.kill(os.getpid(), signal.SIGTERM)
                    assert signals._stopping.wait(timeout=300)  # the signal taken before the error lands
                killed = CppCompileError(["g++", "kernel.cpp"], "g++: fatal error: Killed signal terminated")
                raise BackendCompilerFailed(lambda *a: None, killed, None)
            return real_loss(*args, **kwargs)

        monkeypatch.setattr(variant_module, "draft_loss", loss)

    settings = [f"pipeline={pipeline}", "train.total_steps=8", "checkpoint.every_steps=100"]
    compile_killed_at_third_step(signalled=True)
    with caplog.at_level("WARNING", logger="dflash.trainer.signals"), pytest.raises(StopRequested):
        train(make_cfg(settings, tmp_path / "stopped"))
    assert (
        "stop requested while compiling" in caplog.text
        and "CppCompileError: C++ compile error" in caplog.text
    )
    state = torch.load(tmp_path / "stopped" / "checkpoints" / "last" / "trainer_state.pt", weights_only=True)
    assert state["position"]["step"] == 2
    compile_killed_at_third_step(signalled=False)
    with pytest.raises(BackendCompilerFailed, match="Killed signal"):
        train(make_cfg(settings, tmp_path / "failed"))


def test_a_step_still_running_long_after_a_stop_request_is_shown_where_it_waits(
    make_cfg, tmp_path, monkeypatch
):
    """A stop waits for the step in hand, which may be a first compile of minutes, or a compile
    that will never end (its compiler's processes killed by the same signal: seen on an H200,
    the run silent for six minutes). After pipeline.stop_report_s the log shows each pipeline
    thread's stack, once; the step that then ends is checkpointed as usual."""
    import logging
    import threading

    from dflash.step import variant as variant_module
    from dflash.train import train
    from dflash.trainer.signals import StopRequested

    released, reports = threading.Event(), []

    class Watch(logging.Handler):
        def emit(self, record):
            if "pipeline.stop_report_s" in record.getMessage():
                reports.append(record.getMessage())
                released.set()

    def a_compile_that_takes_its_time():
        assert released.wait(timeout=300), "no report came"

    real_loss, calls = variant_module.draft_loss, []

    def loss(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            a_compile_that_takes_its_time()
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(variant_module, "draft_loss", loss)
    watch = Watch(level=logging.WARNING)
    logging.getLogger("dflash.trainer.async_trainer").addHandler(watch)
    try:
        with pytest.raises(StopRequested):
            train(make_cfg(["pipeline=async", "pipeline.stop_report_s=0.5", "train.total_steps=8"], tmp_path))
    finally:
        logging.getLogger("dflash.trainer.async_trainer").removeHandler(watch)
    assert len(reports) == 1
    assert "--- dflash-drafter0" in reports[0] and "in a_compile_that_takes_its_time" in reports[0]
    state = torch.load(tmp_path / "checkpoints" / "last" / "trainer_state.pt", weights_only=True)
    assert state["position"]["step"] == 2


def test_a_resume_past_the_runs_end_is_refused_in_one_line(make_cfg, tmp_path):
    from dflash.run.launch import build_run
    from dflash.train import train

    train(make_cfg(["train.total_steps=8", "checkpoint.every_steps=8"], tmp_path / "a"))
    checkpoint = tmp_path / "a" / "checkpoints" / "step_0000008"
    for name, shorter in (("total", "train.total_steps=4"), ("max", "debug.max_steps=6")):
        with pytest.raises(
            ValueError, match=r"is at step 8, and this run ends at step [46] .*: nothing left to train"
        ):
            build_run(make_cfg([f"resume={checkpoint}", shorter], tmp_path / name))


def test_home_is_read_only_when_nothing_else_names_the_cache(monkeypatch, tmp_path):
    from dflash.tools.compose import compose_typed

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    assert compose_typed([]).paths.cache_dir == str(tmp_path / "cache")
    monkeypatch.delenv("DFLASH_CACHE_DIR")
    with pytest.raises(ValueError, match=r"^paths.cache_dir: neither DFLASH_CACHE_DIR nor HOME is set"):
        compose_typed([])
    assert compose_typed([f"paths.cache_dir={tmp_path}"]).paths.cache_dir == str(tmp_path)


def test_a_path_starting_with_tilde_is_the_home_directory_wherever_it_is_read(monkeypatch, tmp_path):
    """`~` in paths.output_dir, resume, ... (quoted for Hydra) and in hydra.run.dir means the home
    directory, never a directory named `~`; unquoted, Hydra's lexer error becomes one line."""
    from dflash.tools.compose import compose_typed

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    cfg = compose_typed(["paths.output_dir='~/out'", "resume='~/runs/last'", "paths.cache_dir='~'"])
    assert (cfg.paths.output_dir, cfg.resume, cfg.paths.cache_dir) == (
        f"{home}/out",
        f"{home}/runs/last",
        str(home),
    )
    files = finished_run(home / "old")
    refused = run_tool(
        [sys.executable, "-m", "dflash.train", "hydra.run.dir='~/old'"], env={"HOME": str(home)}
    )
    assert refused.returncode == 2 and f"hydra.run.dir={home}/old holds an earlier run" in refused.stderr
    assert {name: (home / "old" / name).read_text() for name in files} == files
    unquoted = run_tool(
        [sys.executable, "-m", "dflash.train", "hydra.run.dir=~/new"], env={"HOME": str(home)}
    )
    assert unquoted.returncode == 2 and unquoted.stderr.count("\n") == 1
    assert "hydra.run.dir=~/new: Hydra's override grammar reserves '~'; quote the value" in unquoted.stderr
    assert not list(Path.cwd().glob("~*")) and not (home / "new").exists()


def test_a_chat_template_that_does_not_parse_is_refused_at_start_naming_the_file(
    tmp_path, make_cfg, tiny_chat_dir, tiny_conversations, monkeypatch
):
    import shutil

    from dflash.run.launch import build_run
    from dflash.target.model import FrozenTarget
    from tests.conftest import conversation_overrides

    broken = shutil.copytree(tiny_chat_dir, tmp_path / "broken_template")
    (broken / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}\n{% if %}{% endfor %}"
    )

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the chat template was checked")

    monkeypatch.setattr(FrozenTarget, "from_config", no_load)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(broken / 'chat_template.jinja'))}: the chat template does not parse \(line 2: "):  # fmt: skip
        build_run(make_cfg(conversation_overrides(broken, [tiny_conversations])))


def test_a_run_into_a_live_sweeps_job_dir_is_refused_and_changes_nothing(tmp_path, data_cache):
    sweep_dir = tmp_path / "sweep"
    common = FAST + [f"paths.cache_dir={data_cache}", "logger.every_steps=1"]
    sweep = cli(["-m", *common, "train.total_steps=400", "seed=0", f"hydra.sweep.dir={sweep_dir}"])
    job = sweep_dir / "0"
    try:
        wait_for_lines(job / "metrics.jsonl", 2, sweep)
        hydra_config = (job / ".hydra" / "config.yaml").read_text()
        second = run_tool([sys.executable, "-m", "dflash.train", *common, f"hydra.run.dir={job}"])
        assert second.returncode == 2 and "belongs to a run still alive" in second.stderr, second.stderr[
            -2000:
        ]
        assert (job / ".hydra" / "config.yaml").read_text() == hydra_config
    finally:
        sweep.send_signal(signal.SIGTERM)
        sweep.communicate(timeout=CLI_TIMEOUT_S)
    assert json.loads((job / "run.json").read_text())["status"] == "INTERRUPTED"


def incomplete_saved_dataset(tmp_path: Path) -> Path:
    """What save_to_disk writes, less its state.json."""
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}]).save_to_disk(str(saved))
    (saved / "state.json").unlink()
    return saved


@pytest.mark.parametrize("tool", ["train", "prep", "regen"])
def test_a_save_to_disk_directory_without_state_json_is_one_line_naming_it(tmp_path, tiny_chat_dir, tool):
    """Not read as JSON records (where dataset_info.json would be blamed for holding none): every
    tool that reads conversations refuses it through the one reader, naming the directory and the
    missing file."""
    saved = incomplete_saved_dataset(tmp_path)
    expected = f"{saved}: a datasets save_to_disk directory (data-00000-of-00001.arrow) without state.json"
    inputs = (
        [f"input=[{saved}]", f"output={tmp_path / 'out.jsonl'}"]
        if tool == "regen"
        else ["data=conversations", f"data.files=[{saved}]"]
    )
    common = [
        f"target.path={tiny_chat_dir}",
        f"hydra.run.dir={tmp_path / 'run'}",
        f"paths.cache_dir={tmp_path}",
    ]
    result = run_tool(
        [
            sys.executable,
            "-m",
            f"dflash.tools.{tool}" if tool != "train" else "dflash.train",
            *inputs,
            *common,
        ]
    )
    assert result.returncode == 2, result.stderr
    # regen loads its target before reading: the loader's progress bar may come first.
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 or tool == "regen", result.stderr
    assert expected in lines[-1] and "dataset_info.json:" not in result.stderr


def test_masking_secrets_in_hydras_files_never_leaves_half_a_file(tmp_path, monkeypatch):
    """.hydra/config.yaml is rewritten with secrets masked as the job starts: a Ctrl-C in the
    middle of that write leaves the file as Hydra wrote it, and no temporary beside it."""
    from dflash.run.record import mask_hydra_files

    hydra_dir = tmp_path / ".hydra"
    hydra_dir.mkdir()
    original = "logger:\n  api_key: sk-secret\n  project: p\n"
    (hydra_dir / "config.yaml").write_text(original)
    write_text = Path.write_text

    def cut_short(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(KeyboardInterrupt):
        mask_hydra_files(tmp_path, ".hydra")
    monkeypatch.undo()
    assert (hydra_dir / "config.yaml").read_text() == original
    assert [p.name for p in hydra_dir.iterdir()] == ["config.yaml"]
    mask_hydra_files(tmp_path, ".hydra")
    assert "sk-secret" not in (hydra_dir / "config.yaml").read_text()
