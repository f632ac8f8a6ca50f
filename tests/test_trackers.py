"""Trackers as metric sinks, with the real libraries, offline: TensorBoard's event files read back
with TensorBoard's own reader hold every row metrics.jsonl holds, at the same steps."""

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
