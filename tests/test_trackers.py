"""Trackers as metric sinks, with the real libraries, offline: TensorBoard's event files read back
with TensorBoard's own reader hold every row metrics.jsonl holds, at the same steps; a resumed
checkpoint continues its W&B run, and checkpoints are logged as W&B artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.train import train


def test_tensorboard_event_files_hold_the_rows_of_metrics_jsonl(make_cfg):
    pytest.importorskip("tensorboard")  # the `tensorboard` extra (make install brings it)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(["logger=tensorboard", "train.total_steps=4", "logger.every_steps=2"])
    train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("train/loss", "train/acc", "train/tau_sim", "train/window_steps", "eval/tau"):
        expected = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        assert expected, key
        assert key in tags, sorted(tags)
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in logged] == [s for s, _ in expected], key
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), key  # float32


def test_a_missing_tensorboard_is_one_line_naming_the_extra(make_cfg, monkeypatch):
    import builtins

    from dflash.monitor.sinks import SinkContext, TensorBoardSink

    real_import = builtins.__import__

    def without_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_tensorboard)
    with pytest.raises(ValueError, match=r"pip install 'dflash\[tensorboard\]'"):
        TensorBoardSink(context=SinkContext(run_dir=Path("unused"), config={}, total_steps=1))


def test_wandb_resumes_the_run_its_checkpoint_names_and_logs_checkpoints_as_artifacts(
    make_cfg, tmp_path, monkeypatch
):
    import wandb

    from dflash.monitor.sinks import WANDB_RUN_FILE

    monkeypatch.setenv("WANDB_MODE", "offline")
    logged: list[tuple[str, list[str]]] = []
    real_log_artifact = wandb.sdk.wandb_run.Run.log_artifact

    def log_artifact(run, artifact, *args, aliases=None, **kwargs):
        logged.append((artifact.type, sorted(aliases or []), sorted(artifact.manifest.entries)))
        return real_log_artifact(run, artifact, *args, aliases=aliases, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log_artifact", log_artifact)
    common = ["logger=wandb", "train.total_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=3"]
    first = make_cfg([*common, "logger.sinks.wandb.log_checkpoints=true"], tmp_path / "first")
    train(first)
    checkpoints = tmp_path / "first" / "checkpoints"
    run_id = json.loads((checkpoints / "step_0000002" / WANDB_RUN_FILE).read_text())["id"]
    assert json.loads((checkpoints / "last" / WANDB_RUN_FILE).read_text())["id"] == run_id
    assert [(kind, aliases) for kind, aliases, _ in logged] == [
        ("model", ["latest", "step-2"]),
        ("model", ["latest", "step-4"]),
    ]
    assert {"config.json", "model.safetensors", "README.md"} <= set(logged[0][2])

    resumed = make_cfg([*common, f"resume={checkpoints / 'step_0000002'}"], tmp_path / "second")
    train(resumed)  # a new run dir; the same W&B run
    again = json.loads((tmp_path / "second" / "checkpoints" / "last" / WANDB_RUN_FILE).read_text())
    assert again["id"] == run_id
    assert len(logged) == 2  # log_checkpoints is off in the resumed run
