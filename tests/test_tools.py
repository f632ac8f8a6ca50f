"""dflash-report and dflash-schedule on real run output."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from dflash.tools import report
from dflash.tools import schedule as schedule_tool
from dflash.train import train


def test_report_writes_plots_and_a_summary_and_compares_two_runs(make_cfg, tmp_path, capsys, monkeypatch):
    runs = []
    for name, scheduler in (("a", "interleave"), ("b", "shuffle")):
        cfg = make_cfg(
            [f"scheduler={scheduler}", "train.total_steps=12", "logger.every_steps=3", "eval.every_steps=6"],
            tmp_path / name,
        )
        train(cfg)
        runs.append(Path(cfg.paths.output_dir))
    with (runs[0] / "metrics.jsonl").open("a") as f:
        f.write("{not json\n")  # a torn last line must not stop the report
    from matplotlib.figure import Figure

    figures = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), real_savefig(fig, *a, **k))
    )
    report.main([str(runs[0]), "--compare", str(runs[1])])
    assert len(figures) == 7
    for fig in figures:
        for ax in fig.axes:
            assert_series_distinguishable(ax)
    out = runs[0] / "report"
    images = [
        "loss_accuracy.png",
        "buckets.png",
        "grad_norm_queues.png",
        "drafters.png",
        "acceptance.png",
        "gpus.png",
        "compare.png",
    ]
    for name in images:
        assert (out / name).stat().st_size > 10_000, name  # a rendered figure, not an empty file
    summary = (out / "report.md").read_text()
    assert "| metric | a | b |" in summary and "| train/loss |" in summary
    assert all(f"]({name})" in summary for name in images)
    assert "## Device roles" in summary and "roles busy        target " in summary  # from summary.json
    assert "skipping unreadable line" in capsys.readouterr().out


def assert_series_distinguishable(ax) -> None:
    """Every plotted series of an axis looks different from the others (colour, marker and line
    style each), and the legend names exactly the series drawn, each by its own look."""
    lines = [line for line in ax.lines if not line.get_label().startswith("_")]
    looks = [(line.get_color(), line.get_marker(), line.get_linestyle()) for line in lines]
    for i, a in enumerate(looks):
        for b in looks[i + 1 :]:
            assert a[0] != b[0] and a[1] != b[1], (ax.get_title(), looks)
    points = [c for c in ax.collections if not c.get_label().startswith("_") and c.get_offsets().size]
    labels = [line.get_label() for line in lines] + [c.get_label() for c in points]
    if len(labels) > 1:
        legend = ax.get_legend()
        assert legend is not None, ax.get_title()
        assert sorted(t.get_text() for t in legend.get_texts()) == sorted(labels), ax.get_title()
        drawn = {line.get_label(): line for line in lines}
        for handle, text in zip(legend.legend_handles, legend.get_texts()):
            if text.get_text() in drawn:  # a line's legend entry shows that line's colour and marker
                line = drawn[text.get_text()]
                assert (handle.get_color(), handle.get_marker()) == (line.get_color(), line.get_marker())


def test_compared_runs_of_one_folder_name_are_told_apart_by_path(tmp_path):
    assert report.run_labels(tmp_path / "a" / "12-00", tmp_path / "b" / "12-00") == (
        str(tmp_path / "a" / "12-00"),
        str(tmp_path / "b" / "12-00"),
    )
    assert report.run_labels(tmp_path / "x", tmp_path / "y") == ("x", "y")


def test_bucket_mix_per_tick_is_the_delta_of_cumulative_counts():
    rows = [
        {"step": 1, "batch/dispatched": 4, "batch/bucket_0_pct": 50.0, "batch/bucket_1_pct": 50.0},
        {"step": 2, "batch/dispatched": 8, "batch/bucket_0_pct": 25.0, "batch/bucket_1_pct": 75.0},
    ]
    steps, shares = report.bucket_mix_per_tick(rows)
    assert list(steps) == [1, 2]
    assert list(shares["bucket_0"]) == [50.0, 0.0] and list(shares["bucket_1"]) == [50.0, 100.0]


def test_schedule_report_shows_interleave_breaking_runs(make_cfg, capsys, data_cache):
    schedule_tool.main(["data.num_samples=48", f"paths.cache_dir={data_cache}"])
    text = capsys.readouterr().out
    assert "scheduler=shuffle" in text and "scheduler=interleave" in text
    longest = [
        int(line.split("(longest ")[1].rstrip(")")) for line in text.splitlines() if "(longest" in line
    ]
    assert len(longest) == 2 and longest[1] <= longest[0]


def test_schedule_report_statistics():
    buckets = [0, 0, 0, 1, 1, 0, 2]
    assert dict(schedule_tool.run_lengths(buckets)) == {3: 1, 2: 1, 1: 2}
    mean_h, min_h = schedule_tool.windowed_entropy([0, 1, 2, 0, 1, 2], 3, 3)
    assert abs(mean_h - 1.0) < 1e-9 and abs(min_h - 1.0) < 1e-9
    assert schedule_tool.windowed_entropy([0, 0, 0], 3, 3) == (0.0, 0.0)
    text = schedule_tool.report({"x": [0, 0, 0, 1]}, 2, 2)
    assert "scheduler=x: 4 batches" in text and "b0=75.0%  b1=25.0%" in text
    assert "1:1  3:1   (longest 3)" in text and "mean 0.333  min 0.000" in text


def test_median_ms_runs_warmup_then_repeat_calls_and_returns_their_median(monkeypatch):
    """The benchmarks' timer: warm-up calls are not timed; the median is of the timed ones."""
    import torch

    from dflash import stopwatch
    from dflash.tools import timing

    clock = iter([0.0, 0.005, 1.0, 1.001, 2.0, 2.003])  # timed calls of 5, 1 and 3 ms
    monkeypatch.setattr(stopwatch.time, "perf_counter", lambda: next(clock))
    calls = []
    ms = timing.median_ms(lambda: calls.append(1), warmup=2, repeat=3, device=torch.device("cpu"))
    assert len(calls) == 5
    assert abs(ms - 3.0) < 1e-9


def test_back_to_back_ms_times_the_calls_together_and_divides_by_their_count(monkeypatch):
    """bench_step's 'back to back' figure: one clock span around every call, no wait in between."""
    import torch

    from dflash import stopwatch
    from dflash.tools import timing

    clock = iter([10.0, 10.012])  # read once before the first call and once after the last
    monkeypatch.setattr(stopwatch.time, "perf_counter", lambda: next(clock))
    calls = []
    ms = timing.back_to_back_ms(lambda: calls.append(1), repeat=4, device=torch.device("cpu"))
    assert len(calls) == 4
    assert abs(ms - 3.0) < 1e-9


@pytest.mark.parametrize(
    "overrides,message",
    [
        # The tiny target with the script's default mask id (Qwen3's 151669): dflash-train's check.
        (
            ["target=tiny", "drafter=tiny"],
            "drafter.mask_token_id=151669 is outside the target's embedding rows",
        ),
        # A target no machine holds: refused from its meta-device size, before anything is built.
        (
            [
                "target.arch.hidden_size=16384",
                "target.arch.vocab_size=2000000",
                "target.arch.num_hidden_layers=8",
            ],
            r"target=qwen3_8b_random: \d+\.\d+B parameters need \d+\.\d GiB on cpu, which has",
        ),
    ],
    ids=["mask_id_outside_the_vocab", "weights_beyond_the_device"],
)
def test_benchmark_scripts_refuse_like_the_cli_in_one_line(overrides, message, monkeypatch, capsys):
    import runpy

    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_step.py"
    monkeypatch.setattr(sys, "argv", [str(script), *overrides])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(script), run_name="__main__")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-2000:]
    assert re.search(message, err) and err.count("\n") == 1, err[-2000:]


def test_a_benchmarks_defaults_never_shadow_what_the_command_line_sets():
    from dflash.tools.compose import with_defaults

    got = with_defaults(["target=qwen3_8b_random", "gpu=single"], ["gpu=cpu", "drafter.num_layers=3"])
    assert got == ["target=qwen3_8b_random", "gpu=cpu", "drafter.num_layers=3"]
