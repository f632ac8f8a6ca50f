"""Trackers as metric sinks, with the real libraries, offline: TensorBoard's event files read back
with TensorBoard's own reader hold every row metrics.jsonl holds, at the same steps; MLflow's store
read back with MLflow's own client holds every row, the config and the summary, a resumed
checkpoint continues its MLflow run and a crash marks the run failed; a resumed checkpoint
continues its W&B run, and checkpoints are logged as W&B artifacts. A tracker's missing library
is one line naming the extra, before anything loads; so is a tracker that cannot take the run (an
MLflow or W&B server that does not answer, a read-only SQLite store, a directory that cannot be
written), refused in seconds naming the key."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash.train import train
from tests.conftest import SLOW_MACHINE_TIMEOUT_S


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


@pytest.mark.parametrize(
    ("sink", "hidden", "extra"),
    [("TensorBoardSink", "torch.utils.tensorboard", "tensorboard"), ("MlflowSink", "mlflow", "mlflow")],
)
def test_a_missing_tracker_library_is_one_line_naming_the_extra(sink, hidden, extra, tmp_path, monkeypatch):
    from dflash.monitor import sinks

    monkeypatch.setitem(sys.modules, hidden, None)  # what an import finds when it is not installed
    with pytest.raises(ValueError, match=rf"pip install 'dflash\[{extra}\]'"):
        getattr(sinks, sink)(context=sinks.SinkContext(run_dir=tmp_path, config={}, total_steps=1))


def refusal_of_train(tmp_path: Path, *overrides: str, prelude: str = "") -> str:
    """`dflash train logger=mlflow debug=fast OVERRIDES` in a process of its own (after `prelude`):
    it must exit 2 with one line on stderr, before any checkpoint; that line."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"{prelude}from dflash.cli import main; main()",
            "train",
            "logger=mlflow",
            *overrides,
            "debug=fast",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=SLOW_MACHINE_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert not (tmp_path / "checkpoints").exists()
    return lines[0]


def test_logger_mlflow_without_mlflow_exits_2_in_one_line_before_anything_loads(tmp_path):
    line = refusal_of_train(tmp_path, prelude="import sys; sys.modules['mlflow'] = None; ")
    assert line.startswith(
        "dflash train: error: logger.sinks.mlflow (logger=mlflow) needs the mlflow package: "
        "pip install 'dflash[mlflow]'"
    ), line


def mlflow_store(run_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return client, runs


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def jsonl_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_mlflow_store_holds_every_row_the_config_and_the_summary_and_resume_continues_the_run(
    make_cfg, tmp_path
):
    pytest.importorskip("mlflow")  # the `mlflow` extra (make install brings it)
    from dflash.monitor.sinks import MLFLOW_RUN_FILE

    common = [
        "logger=mlflow",
        "train.total_steps=4",
        "logger.every_steps=2",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=3",
    ]
    first_dir = tmp_path / "first"
    train(make_cfg(common, first_dir))
    client, runs = mlflow_store(first_dir)  # the default store: a SQLite file in the run dir
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "dflash"
    assert run.info.run_name == "/".join(first_dir.parts[-2:])
    # Every value of every row, at its step (float64 in metrics.jsonl and in the store: equal).
    rows = jsonl_rows(first_dir)
    keys = {key for row in rows for key in row if key != "step"}
    assert {"train/loss", "eval/tau", "monitor/mlflow_dropped"} <= keys
    assert keys == {key for key in run.data.metrics if not key.startswith("summary/")}
    for key in keys:
        expected = sorted((r["step"], r[key]) for r in rows if r.get(key) is not None)
        assert history(client, run.info.run_id, key) == expected, key
    # The config: one param per leaf, and the whole of it as an artifact.
    params = run.data.params
    assert params["train.total_steps"] == "4" and params["logger.every_steps"] == "2"
    assert params["logger.sinks.mlflow._target_"] == "dflash.monitor.sinks.mlflow_sink"
    assert params["optimizer.betas"] == "[0.9, 0.999]" and params["resume"] == "null"
    logged_config = Path(client.download_artifacts(run.info.run_id, "config_resolved.yaml", str(tmp_path)))
    assert yaml.safe_load(logged_config.read_text()) == yaml.safe_load(
        (first_dir / "config_resolved.yaml").read_text()
    )
    # The summary: its numbers as metrics at the last step, the rest as tags.
    summary = json.loads((first_dir / "summary.json").read_text())
    for key in ("train/loss", "train/acc", "eval/tau", "steps"):
        assert history(client, run.info.run_id, f"summary/{key}") == [(4, summary[key])], key
    assert run.data.tags["summary/checkpoint"] == summary["checkpoint"]
    checkpoints = first_dir / "checkpoints"
    record = json.loads((checkpoints / "step_0000002" / MLFLOW_RUN_FILE).read_text())
    assert record == json.loads((checkpoints / "last" / MLFLOW_RUN_FILE).read_text())
    assert record["run_id"] == run.info.run_id

    # resume= of step 2, in a new run dir: the same MLflow run, in the store the checkpoint names.
    second_dir = tmp_path / "second"
    train(make_cfg([*common, f"resume={checkpoints / 'step_0000002'}"], second_dir))
    assert not (second_dir / "mlflow.db").exists()
    client, runs = mlflow_store(first_dir)
    assert [r.info.run_id for r in runs] == [record["run_id"]]
    assert runs[0].info.status == "FINISHED"
    resumed_rows = jsonl_rows(second_dir)
    assert resumed_rows and all(r["step"] > 2 for r in resumed_rows)
    for key in ("train/loss", "train/acc", "eval/tau"):
        both = [(r["step"], r[key]) for r in rows + resumed_rows if r.get(key) is not None]
        assert history(client, record["run_id"], key) == sorted(both), key
    assert json.loads((second_dir / "checkpoints" / "last" / MLFLOW_RUN_FILE).read_text()) == record
    assert runs[0].data.tags["dflash.resumed_from"].endswith("step_0000002 (step 2)")
    assert [a.path for a in client.list_artifacts(record["run_id"], "resume_step_2")] == [
        "resume_step_2/config_resolved.yaml"
    ]


class CrashAtStart:
    """A callback that fails the run before its first step."""

    def on_train_start(self, trainer) -> None:
        raise RuntimeError("crash at start")


def test_a_run_that_crashes_ends_its_mlflow_run_failed(make_cfg, tmp_path):
    pytest.importorskip("mlflow")
    cfg = make_cfg(
        ["logger=mlflow", "train.total_steps=2", f"+callbacks.crash._target_={__name__}.CrashAtStart"],
        tmp_path / "run",
    )
    with pytest.raises(RuntimeError, match="crash at start"):
        train(cfg)
    _, runs = mlflow_store(tmp_path / "run")
    assert [r.info.status for r in runs] == ["FAILED"]


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


def test_resuming_into_an_mlflow_store_that_is_gone_is_refused_before_anything_loads(make_cfg, tmp_path):
    """The checkpoint names its run's store; with that store deleted, `resume=` stops in the
    checks before the weights (the new run dir gets no config_resolved.yaml), naming the key."""
    pytest.importorskip("mlflow")
    common = ["logger=mlflow", "train.total_steps=2", "checkpoint.every_steps=2"]
    first_dir = tmp_path / "first"
    train(make_cfg(common, first_dir))
    (first_dir / "mlflow.db").unlink()
    second_dir = tmp_path / "second"
    checkpoint = first_dir / "checkpoints" / "step_0000002"
    with pytest.raises(ValueError, match=r"which does not exist; set logger.sinks.mlflow.tracking_uri"):
        train(make_cfg([*common, f"resume={checkpoint}"], second_dir))
    assert not (second_dir / "config_resolved.yaml").exists()


# -- a tracker that cannot take the run is refused in seconds, before any weights load ----------


@pytest.fixture
def no_weights_load(monkeypatch):
    """Loading the target fails the test: every refusal below must come before it."""
    from dflash.target.model import FrozenTarget

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the tracker was checked")

    monkeypatch.setattr(FrozenTarget, "from_config", no_load)


@pytest.fixture(params=["closed", "silent"])
def dead_server(request):
    """A loopback address where no HTTP answer comes: a port nothing listens on (refused at
    once), or a listening socket that never accepts (the request waits for the timeout)."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if request.param == "closed":
        sock.close()
        yield f"http://127.0.0.1:{port}", "does not answer"
        return
    sock.listen(8)
    yield f"http://127.0.0.1:{port}", "does not answer within 1 s"
    sock.close()


def test_an_mlflow_server_that_does_not_answer_is_refused_before_anything_loads(
    make_cfg, dead_server, no_weights_load
):
    pytest.importorskip("mlflow")
    from dflash.run.launch import build_run

    uri, reason = dead_server
    cfg = make_cfg(
        [
            "logger=mlflow",
            f"logger.sinks.mlflow.tracking_uri={uri}",
            "logger.sinks.mlflow.connect_timeout_s=1",
        ]
    )
    with pytest.raises(
        ValueError, match=rf"^logger.sinks.mlflow.tracking_uri={uri}: the MLflow store {reason}"
    ):
        build_run(cfg)


def test_an_mlflow_server_in_the_environment_that_does_not_answer_is_named_with_the_key(
    make_cfg, dead_server, no_weights_load, monkeypatch
):
    pytest.importorskip("mlflow")
    from dflash.run.launch import build_run

    uri, reason = dead_server
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = make_cfg(["logger=mlflow", "logger.sinks.mlflow.connect_timeout_s=1"])
    with pytest.raises(
        ValueError,
        match=rf"^MLFLOW_TRACKING_URI={uri}: the MLflow store {reason}.*"
        r"set logger.sinks.mlflow.tracking_uri",
    ):
        build_run(cfg)


@pytest.mark.slow  # a CLI process: ~25 s on a busy 2-core machine
def test_an_unreachable_mlflow_server_exits_2_in_one_line_naming_the_key(tmp_path):
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    line = refusal_of_train(tmp_path, f"logger.sinks.mlflow.tracking_uri={uri}")
    assert line.startswith(
        f"dflash train: error: logger.sinks.mlflow.tracking_uri={uri}: the MLflow store does not answer ("
    ), line


def test_a_read_only_sqlite_store_is_refused_before_anything_loads(make_cfg, tmp_path, no_weights_load):
    """A SQLite store opened read-only: MLflow's engine retries it for 110 s, then fails."""
    pytest.importorskip("mlflow")
    import sqlite3

    from dflash.run.launch import build_run

    database = tmp_path / "shared" / "mlflow.db"
    database.parent.mkdir()
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE runs (id TEXT)")
    uri = f"sqlite:///file:{database}?mode=ro&uri=true"
    cfg = make_cfg(["logger=mlflow", f"logger.sinks.mlflow.tracking_uri='{uri}'"])
    with pytest.raises(
        ValueError,
        match=rf"^logger.sinks.mlflow.tracking_uri={re.escape(uri)}: the MLflow store cannot be written "
        r"\(.*readonly database\)",
    ):
        build_run(cfg)
    missing = f"sqlite:///file:{tmp_path / 'none.db'}?mode=ro&uri=true"
    with pytest.raises(ValueError, match=r"the MLflow store does not exist, and is opened read-only"):
        build_run(make_cfg(["logger=mlflow", f"logger.sinks.mlflow.tracking_uri='{missing}'"]))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a file whatever its mode")
def test_a_sqlite_store_without_write_permission_is_refused(make_cfg, tmp_path, no_weights_load):
    pytest.importorskip("mlflow")
    import sqlite3

    from dflash.run.launch import build_run

    database = tmp_path / "mlflow.db"
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE runs (id TEXT)")
    database.chmod(0o444)
    cfg = make_cfg(["logger=mlflow", f"logger.sinks.mlflow.tracking_uri=sqlite:///{database}"])
    with pytest.raises(
        ValueError, match=r"logger.sinks.mlflow.tracking_uri=.*: the MLflow store cannot be written"
    ):
        build_run(cfg)


def test_a_tensorboard_dir_that_cannot_be_written_is_refused_before_anything_loads(
    make_cfg, tmp_path, no_weights_load
):
    pytest.importorskip("tensorboard")
    from dflash.run.launch import build_run

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = make_cfg(["logger=tensorboard", f"logger.sinks.tensorboard.subdir={blocker / 'tb'}"])
    with pytest.raises(
        ValueError, match=rf"^logger.sinks.tensorboard.subdir: {blocker / 'tb'} cannot be a directory"
    ):
        build_run(cfg)


def test_a_wandb_server_that_does_not_answer_is_refused_before_anything_loads(
    make_cfg, dead_server, no_weights_load, monkeypatch
):
    from dflash.run.launch import build_run

    uri, reason = dead_server
    monkeypatch.setenv("WANDB_BASE_URL", uri)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    cfg = make_cfg(
        ["logger=wandb", "logger.sinks.wandb.mode=online", "logger.sinks.wandb.connect_timeout_s=1"]
    )
    with pytest.raises(
        ValueError, match=rf"^logger.sinks.wandb \(mode=online\): the W&B server {uri} {reason}"
    ):
        build_run(cfg)


def test_an_offline_wandb_run_that_cannot_start_is_one_line_naming_the_key(
    make_cfg, tmp_path, no_weights_load
):
    """W&B's directory in the run dir is taken by a file: refused before loading, and by the sink
    itself (W&B's own error, in one line) when it comes to that later."""
    from dflash.monitor.sinks import SinkContext, WandbSink
    from dflash.run.launch import build_run

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("")
    with pytest.raises(ValueError, match=r"^logger.sinks.wandb: .*wandb cannot be a directory"):
        build_run(make_cfg(["logger=wandb", "logger.sinks.wandb.mode=offline"], run_dir))
    with pytest.raises(
        ValueError, match=r"^logger.sinks.wandb \(mode=offline\): W&B could not start the run"
    ):
        WandbSink(context=SinkContext(run_dir=run_dir, config={}, total_steps=1), mode="offline")


@pytest.mark.parametrize(
    ("library", "overrides", "typo"),
    [
        (
            "wandb",
            ["logger=wandb", "logger.sinks.wandb.mode=offline", "+logger.sinks.wandb.projct=mine"],
            "projct",
        ),
        ("mlflow", ["logger=mlflow", "+logger.sinks.mlflow.experimnt=mine"], "experimnt"),
    ],
)
def test_a_mistyped_tracker_setting_is_refused_before_anything_loads(
    library, overrides, typo, make_cfg, no_weights_load
):
    """A tracker's factory takes its sink's own settings: a key the sink does not take is named
    before the weights load, not as the factory's failure once training is ready to log."""
    pytest.importorskip(library)
    from dflash.run.launch import build_run

    with pytest.raises(ValueError, match=rf"^logger.sinks.{library}: .*'{typo}'"):
        build_run(make_cfg(overrides))


@pytest.mark.parametrize(
    ("target", "subdir", "says"),
    [
        ("dflash.monitor.sinks.TensorBoardSink", "tensorboard", "logger.sinks.mine.subdir"),
        ("dflash.monitor.sinks.wandb_sink", "wandb", "logger.sinks.mine"),
    ],
)
def test_an_entry_that_leaves_its_settings_out_is_checked_where_the_sink_will_write(
    target, subdir, says, tmp_path
):
    """An entry of `_target_` alone: its destination is checked with the sink's own defaults."""
    from dflash.monitor.sinks import check_sink_destinations

    (tmp_path / subdir).write_text("")  # a file where the sink's directory would go
    with pytest.raises(ValueError, match=rf"^{re.escape(says)}: .*{subdir} cannot be a directory"):
        check_sink_destinations({"mine": {"_target_": target}}, run_dir=tmp_path, resume_dir=None)
