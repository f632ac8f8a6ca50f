"""User code plugged in by config alone: the callback example of docs/extending.md, written into a
module outside the package, receives every hook in a normal run; a callback that cannot be
built is refused before anything loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.run.launch import build_run
from tests.conftest import FAST, SLOW_MACHINE_TIMEOUT_S

DOC = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


def doc_example() -> str:
    """The first python block of docs/extending.md."""
    return re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)


def test_the_documented_callback_receives_every_hook_of_a_run(tmp_path, data_cache):
    (tmp_path / "my_callbacks.py").write_text(doc_example())
    hooks = tmp_path / "hooks.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [
            sys.executable, "-m", "dflash.train", *FAST, "train.total_steps=6", "checkpoint.every_steps=3",
            "logger.every_steps=2", f"paths.cache_dir={data_cache}", f"hydra.run.dir={tmp_path / 'run'}",
            "+callbacks.rec._target_=my_callbacks.RecordingCallback", f"+callbacks.rec.path={hooks}",
        ],
        capture_output=True, text=True, env=env, timeout=SLOW_MACHINE_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [json.loads(line) for line in hooks.read_text().splitlines()]
    names = [call["hook"] for call in calls]
    assert names[0] == "on_train_start" and names[-1] == "on_train_end" and names.count("on_train_start") == 1
    logged = [call for call in calls if call["hook"] == "on_log"]
    train_rows = [call for call in logged if "train/loss" in call["keys"]]
    assert [call["step"] for call in train_rows] == [2, 4, 6] and all(call["loss"] > 0 for call in train_rows)
    assert any("eval/tau" in call["keys"] for call in logged)  # the final evaluation's row too
    checkpoints = [call for call in calls if call["hook"] == "on_checkpoint"]
    assert [call["step"] for call in checkpoints][:2] == [3, 6]
    assert all(Path(call["path"], "model.safetensors").is_file() for call in checkpoints)
    (evaluation,) = [call for call in calls if call["hook"] == "on_eval"]
    assert evaluation["tau"] >= 1.0 and calls[-1]["steps"] == 6
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["config"]["callbacks"]["rec"]["_target_"] == "my_callbacks.RecordingCallback"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["+callbacks.bad.path=/tmp/x"], "callbacks.bad needs a _target_"),
        (["+callbacks.bad._target_=no_such_module.Nope"], "callbacks.bad: cannot build no_such_module.Nope"),
        (["+callbacks.bad._target_=pathlib.Path"], r"callbacks.bad: pathlib.Path defines none of the hooks"),
    ],
)
def test_a_callback_that_cannot_serve_is_refused_before_any_model_loads(
    overrides, message, make_cfg, monkeypatch
):
    from dflash.models.target import FrozenTarget

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the callbacks were built")

    monkeypatch.setattr(FrozenTarget, "from_config", no_load)
    with pytest.raises(ValueError, match=message):
        build_run(make_cfg(overrides))
