"""Sweeps: isolated multirun jobs with run records, failures recorded, and dflash-diff."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash.tools import diff
from tests.conftest import SLOW_MACHINE_TIMEOUT_S

SMALL = ["data.num_samples=64", "train.epochs=1", "eval.num_prompts=1", "eval.max_new_tokens=8"]


def sweep(tmp_path: Path, data_cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.train",
            "-m",
            *args,
            *SMALL,
            f"paths.cache_dir={data_cache}",
            f"hydra.sweep.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=SLOW_MACHINE_TIMEOUT_S,
    )


@pytest.mark.slow
def test_two_by_two_sweep_is_isolated_recorded_and_diffable(tmp_path, data_cache, capsys):
    result = sweep(tmp_path, data_cache, "scheduler=shuffle,interleave", "loss.gamma=4,7")
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = [tmp_path / str(i) for i in range(4)]
    records = [json.loads((job / "run.json").read_text()) for job in jobs]
    for job, record in zip(jobs, records):
        assert record["status"] == "COMPLETED" and (job / "metrics.jsonl").is_file()
        assert record["threads_at_start"] == []  # nothing of the previous job still runs
        assert record["metrics"]["eval/lossless_frac"] == 1.0
        assert record["versions"]["torch"] and record["git"]["commit"] and record["devices"]["cpu_count"]
        assert record["end_time"] >= record["start_time"]
    assert [(r["choices"]["scheduler"], r["config"]["loss"]["gamma"]) for r in records] == [
        ("shuffle", 4.0),
        ("shuffle", 7.0),
        ("interleave", 4.0),
        ("interleave", 7.0),
    ]

    diff.main([str(jobs[0]), str(jobs[3])])
    text = capsys.readouterr().out
    choices = text.split("choices:")[1].split("config:")[0]
    config = text.split("config:")[1].split("metrics:")[0]
    assert [line.strip() for line in choices.strip().splitlines() if not line.startswith("      ")] == [
        "scheduler: shuffle -> interleave"
    ]
    assert [line.strip() for line in config.strip().splitlines()] == ["loss.gamma: 4 -> 7"]
    assert "eval/tau" in text and "train/loss" in text

    diff.main([str(tmp_path)])  # the sweep dir: each job against the common base
    deltas = capsys.readouterr().out
    assert "everything but scheduler, loss.gamma" in deltas
    assert "3: scheduler=interleave, loss.gamma=7" in deltas


@pytest.mark.slow
def test_an_optuna_search_over_gamma_and_lr_records_every_trial_and_the_best(tmp_path, data_cache):
    """experiment=search_gamma_lr (hydra/sweeper=optuna, the `sweep` extra) on the tiny default:
    each trial draws gamma and lr from the search space, trains, and returns the objective; its
    run.json is in its job dir as for a grid, and the best trial is the one with the best
    objective."""
    import yaml

    result = sweep(tmp_path, data_cache, "experiment=search_gamma_lr", "hydra.sweeper.n_trials=3")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads((tmp_path / str(i) / "run.json").read_text()) for i in range(3)]
    drawn = []
    for record in records:
        assert record["status"] == "COMPLETED" and record["choices"]["hydra/sweeper"] == "optuna"
        gamma, lr = record["config"]["loss"]["gamma"], record["config"]["optimizer"]["lr"]
        assert 3 <= gamma <= 10 and 1e-4 <= lr <= 3e-3
        drawn.append((gamma, lr))
    assert len(set(drawn)) == 3  # a search: three different points, none of them the default
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    taus = [record["metrics"]["eval/tau"] for record in records]
    assert best["best_value"] == max(taus)
    winner = records[taus.index(max(taus))]["config"]
    assert best["best_params"] == {
        "loss.gamma": winner["loss"]["gamma"],
        "optimizer.lr": winner["optimizer"]["lr"],
    }


@pytest.mark.slow
def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path, data_cache):
    result = sweep(tmp_path, data_cache, "gpu.target=2,1")  # job 0 asks for an impossible split
    assert result.returncode != 0  # Hydra reports the failure once every job has run
    failed, ok = (json.loads((tmp_path / str(i) / "run.json").read_text()) for i in range(2))
    assert failed["status"] == "FAILED" and "gpu.target=2" in failed["error"]
    assert ok["status"] == "COMPLETED" and ok["metrics"]["steps"] > 0


def write_run(path: Path, config: dict, choices: dict, metrics: dict, status: str = "COMPLETED") -> Path:
    path.mkdir(parents=True)
    record = {"config": config, "choices": choices, "metrics": metrics, "status": status, "error": None}
    (path / "run.json").write_text(json.dumps(record))
    return path


def test_diff_reports_choices_changed_added_removed_and_ignores_paths(tmp_path, capsys):
    base = {
        "optimizer": {"lr": 6e-4, "betas": [0.9, 0.999]},
        "paths": {"output_dir": "/a"},
        "noise": {"_target_": "dflash.step.noise.NoNoise"},
    }
    other = {
        "optimizer": {"lr": 6e-4, "betas": [0.9, 0.95]},
        "paths": {"output_dir": "/b"},
        "noise": {"_target_": "dflash.step.noise.MaskRampNoise", "start": 0.5},
        "extra": 1,
    }
    a = write_run(tmp_path / "a", base, {"noise": "none", "gpu": "cpu"}, {"eval/tau": 1.3})
    b = write_run(tmp_path / "b", other, {"noise": "mask_ramp", "gpu": "cpu"}, {"eval/tau": 1.4})
    diff.main([str(a), str(b)])
    text = capsys.readouterr().out
    assert "noise: none -> mask_ramp" in text
    assert "noise._target_: dflash.step.noise.NoNoise -> dflash.step.noise.MaskRampNoise" in text
    assert "noise.start: added (0.5)" in text and "extra: added (1)" in text
    assert "optimizer.betas: [0.9, 0.999] -> [0.9, 0.95]" in text
    assert "paths.output_dir" not in text and "gpu" not in text and "optimizer.lr" not in text
    diff.main([str(a), str(b), "--all", "--format", "markdown"])
    table = capsys.readouterr().out
    assert table.startswith("| | `a` | `b` |") and "| optimizer.lr | 0.0006 | 0.0006 |" in table
    assert "| *eval/tau* | 1.3 | 1.4 |" in table


def test_diff_against_defaults_and_a_checkpoint_dir(tmp_path, capsys):
    from omegaconf import OmegaConf

    from tests.conftest import compose_config

    cfg = compose_config(["loss.gamma=5", "scheduler=shuffle"], output_dir=tmp_path / "run")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    diff.main([str(checkpoint), "--defaults"])
    text = capsys.readouterr().out
    assert "loss.gamma: 4 -> 5" in text
    assert (
        "scheduler._target_: dflash.data.scheduler.InterleavePlanner -> dflash.data.scheduler.ShufflePlanner"
        in text
    )


@pytest.mark.slow
def test_submitit_launcher_runs_each_job_in_its_own_process(tmp_path, data_cache):
    """The SLURM launcher path, through submitit's local executor (same plugin, no cluster)."""
    result = sweep(
        tmp_path,
        data_cache,
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        "loss.gamma=4,7",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads((tmp_path / str(i) / "run.json").read_text()) for i in range(2)]
    assert [r["status"] for r in records] == ["COMPLETED", "COMPLETED"]
    assert [r["config"]["loss"]["gamma"] for r in records] == [4.0, 7.0]
    assert records[0]["devices"]["host"] and records[0]["choices"]["hydra/launcher"] == "submitit_local"


def test_slurm_launcher_option_composes_with_the_keys_users_set():
    from dflash.tools.compose import compose_config

    overrides = [
        "hydra/launcher=slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.nodes=2",
        "hydra.launcher.setup=['source ~/venv/bin/activate']",
    ]
    cfg = compose_config(overrides, return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (
        "gpu",
        2,
        1,
        8,
    )
    assert list(launcher.setup) == ["source ~/venv/bin/activate"] and launcher.timeout_min == 2880


def test_wandb_groups_sweep_jobs_and_names_them_by_their_overrides():
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf, open_dict

    from dflash.monitor.sinks import sweep_naming
    from dflash.tools.compose import compose_config

    def hydra_context(mode: RunMode) -> None:
        cfg = compose_config(["loss.gamma=7"], return_hydra_config=True)
        OmegaConf.set_readonly(cfg, False)
        with open_dict(cfg):
            cfg.hydra.mode = mode
            cfg.hydra.sweep.dir = "multirun/2026-11-29/11-16-24"
            cfg.hydra.job.override_dirname = "loss.gamma=7,scheduler=shuffle"
        HydraConfig.instance().set_config(cfg)

    try:
        hydra_context(RunMode.MULTIRUN)
        assert sweep_naming() == ("11-16-24", "loss.gamma=7,scheduler=shuffle")
        hydra_context(RunMode.RUN)
        assert sweep_naming() == (None, None)  # a single run keeps W&B's own naming
    finally:
        HydraConfig.instance().cfg = None


@pytest.mark.slow
def test_a_search_records_failed_trials_skips_them_and_always_writes_its_results(tmp_path, data_cache):
    """Optuna (experiment=search_gamma_lr): a trial that fails (eval.num_prompts=0 is refused) is
    recorded and told to Optuna as failed, and the search goes on; optimization_results.yaml
    holds every trial and the best. Past max_failed_jobs failures the search stops, in one line,
    with the file written."""

    def search(sweep_dir: Path, *extra: str) -> subprocess.CompletedProcess:
        small = [arg for arg in SMALL if not arg.startswith("eval.num_prompts=")]
        args = ["experiment=search_gamma_lr", "hydra.sweeper.n_trials=4", "train.total_steps=2", "eval.num_prompts=choice(1,0)"]  # fmt: skip
        command = [sys.executable, "-m", "dflash.train", "-m", *args, *small, *extra]
        command += [f"paths.cache_dir={data_cache}", f"hydra.sweep.dir={sweep_dir}"]
        return subprocess.run(command, capture_output=True, text=True, timeout=SLOW_MACHINE_TIMEOUT_S)

    result = search(tmp_path / "search")
    assert result.returncode == 0, result.stderr[-3000:]
    results = yaml.safe_load((tmp_path / "search" / "optimization_results.yaml").read_text())
    statuses = [trial["status"] for trial in results["trials"]]
    assert len(statuses) == 4 and 1 <= results["failed"] == statuses.count("FAILED") < 4
    failed = next(t for t in results["trials"] if t["status"] == "FAILED")
    assert failed["params"]["eval.num_prompts"] == 0 and "eval.num_prompts must be >= 1" in failed["error"]
    assert results["best_params"]["eval.num_prompts"] == 1 and results["best_value"] is not None
    stopped = search(tmp_path / "stopped", "hydra.callbacks.run_record.max_failed_jobs=0")
    assert stopped.returncode == 1 and "trials failed, more than hydra.callbacks.run_record.max_failed_jobs=0: search stopped" in stopped.stderr  # fmt: skip
    partial = yaml.safe_load((tmp_path / "stopped" / "optimization_results.yaml").read_text())
    assert partial["failed"] == 1 and partial["trials"][-1]["status"] == "FAILED"
