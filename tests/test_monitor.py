"""The monitor: every metric family reaches the sinks with plausible values, a stalled sink never
holds up training, and missing NVML costs only its own metrics and one warning; dflash-report
draws each drafter variant's own figures and leaves no panel blank."""

from __future__ import annotations

import json
import logging
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from dflash.monitor.sinks import EVAL_STEP, BackgroundSink, SinkContext, WandbSink
from dflash.monitor.telemetry import GpuTelemetry
from dflash.run.launch import build_run
from tests.conftest import record_wandb_rows

FAMILIES = ("train/", "drafter0/", "drafter1/", "batch/", "queue/", "worker/", "perf/")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_async_run_logs_every_family_with_plausible_values(make_cfg, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = make_cfg(
        [
            "pipeline=async",
            "gpu.target=2",
            "gpu.drafter=2",
            "train.total_steps=12",
            "logger.every_steps=3",
            "logger=wandb",
        ]
    )
    run = build_run(cfg)
    sent = record_wandb_rows(run, monkeypatch)
    run.execute()
    run_dir = Path(cfg.paths.output_dir)
    ticks = [r for r in rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in ticks] == [3, 6, 9, 12]
    for row in ticks:
        for family in FAMILIES:
            assert any(k.startswith(family) for k in row), (family, sorted(row))
        assert all(isinstance(v, float) for k, v in row.items() if k != "step")
        assert sum(row[f"batch/bucket_{i}_pct"] for i in range(3)) == pytest.approx(100.0)
        assert 0.0 < row["batch/padding_efficiency"] <= 1.0
        assert 0.0 <= row["batch/bucket_entropy"] <= 1.0
        assert 1 <= row["batch/same_bucket_run_max"] <= 3
        assert row["drafter0/opt_step"] == row["drafter1/opt_step"] == row["step"]
        assert row["drafter0/lr"] == row["drafter1/lr"] == row["train/lr"]
        assert any(k.startswith("train/loss_bucket_") for k in row)
        assert 0.0 <= row["queue/hs_fill"] <= 1.0
        for name in ("target0", "target1", "drafter0", "drafter1"):
            assert row[f"worker/{name}_batches"] >= 0 and 0.0 <= row[f"worker/{name}_busy_frac"] <= 1.0
            assert 0.0 <= row[f"worker/{name}_compute_frac"] <= 1.0
        assert row["perf/tokens_per_s"] > 0 and 0.0 <= row["perf/data_wait_frac"] <= 1.0
        # Each role's device-busy share, averaged over its devices (CPU: the host time of its work).
        assert 0.0 <= row["perf/target_busy_frac"] <= 1.0 and 0.0 <= row["perf/drafter_busy_frac"] <= 1.0
        assert not any(k.startswith("gpu/") for k in row)  # no GPU here: left out, not zero
    assert ticks[-1]["worker/drafter0_batches"] + ticks[-1]["worker/drafter1_batches"] == 24
    assert any(t["perf/target_busy_frac"] > 0 for t in ticks) and any(
        t["perf/drafter_busy_frac"] > 0 for t in ticks
    )

    # The W&B sink (a real offline run) received every tick with the same keys as metrics.jsonl.
    # (W&B rows with eval/ or val/ figures also carry the snapshot's step, their own x-axis.)
    jsonl_rows = [{k: v for k, v in r.items() if k != "step"} for r in rows(run_dir)]
    assert [sorted(k for k in r if k != EVAL_STEP) for r in sent] == [sorted(r) for r in jsonl_rows]
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_an_evaluation_logged_after_later_steps_still_reaches_wandb(tmp_path, monkeypatch):
    """W&B ignores a row whose step is below its current one; a periodic evaluation of step 3
    finishes after step 6 was logged. Its row goes in at W&B's current step instead, carrying the
    snapshot's step, the x-axis eval/ and val/ figures plot against (a real offline run)."""
    sink = WandbSink(context=SinkContext(run_dir=tmp_path, config={}, total_steps=10), mode="offline")
    calls: list[tuple[dict, int | None]] = []
    real_log = sink.run.log
    monkeypatch.setattr(
        sink.run, "log", lambda data, step=None: (calls.append((dict(data), step)), real_log(data, step=step))
    )
    sink.log({"train/loss": 2.0}, step=3)
    sink.log({"train/loss": 1.5}, step=6)
    sink.log({"eval/tau": 1.4, "val/loss": 1.9}, step=3)
    sink.log({"eval/tau": 1.6}, step=9)
    sink.close(True)
    assert [step for _, step in calls] == [3, 6, None, 9]
    assert calls[2][0] == {"eval/tau": 1.4, "val/loss": 1.9, EVAL_STEP: 3.0}
    assert calls[3][0] == {"eval/tau": 1.6, EVAL_STEP: 9.0} and EVAL_STEP not in calls[0][0]


def test_a_stalled_sink_does_not_hold_up_training(make_cfg):
    release = threading.Event()

    class StalledSink:
        calls = 0

        def log(self, metrics, step):
            StalledSink.calls += 1
            release.wait()  # a W&B upload that never returns

        def close(self, ok):
            pass

    run = build_run(make_cfg(["train.total_steps=20", "logger.every_steps=1"]))
    stalled = BackgroundSink("stalled", StalledSink(), queue_size=3, close_timeout_s=0.5)
    run.trainer.monitor.sinks.append(stalled)
    finished = threading.Event()
    worker = threading.Thread(target=lambda: (run.execute(), finished.set()))
    worker.start()
    worker.join(120)
    release.set()
    assert finished.is_set()  # training, eval and close all completed while the sink was stuck
    assert StalledSink.calls == 1 and stalled.dropped >= 20 - 1 - 3
    jsonl = [r for r in rows(Path(run.run_dir)) if "train/loss" in r]
    assert len(jsonl) == 20 and jsonl[-1]["monitor/stalled_dropped"] > 0


def test_without_nvml_gpu_metrics_are_left_out_after_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as if nvidia-ml-py were absent
    with caplog.at_level(logging.WARNING):
        telemetry = GpuTelemetry({"target": [torch.device("cuda:0")], "drafter": [torch.device("cuda:1")]})
        assert telemetry.read() == {} and telemetry.read() == {}
    assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1


def fake_nvml(unsupported: str) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU, nv.NVML_CLOCK_SM = 0, 1
    nv.nvmlInit = nv.nvmlShutdown = lambda: None
    handles = {"GPU-aaaa": "h-aaaa", "GPU-bbbb": "h-bbbb"}
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: handles[uuid]
    value = {"h-aaaa": 10, "h-bbbb": 30}
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=value[h])
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=value[h] * 1e9)
    nv.nvmlDeviceGetPowerUsage = lambda h: value[h] * 1000
    nv.nvmlDeviceGetTemperature = lambda h, sensor: value[h] + 40
    nv.nvmlDeviceGetClockInfo = lambda h, clock: 1980
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: ["this run"] * (1 if h == "h-aaaa" else 3)

    def unsupported_field(h):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0
    setattr(nv, unsupported, unsupported_field)
    return nv


def test_nvml_maps_devices_by_uuid_and_drops_unsupported_fields(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml("nvmlDeviceGetPowerUsage"))
    # CUDA index 0 is NVML's "bbbb" and index 1 is "aaaa": NVML ignores CUDA_VISIBLE_DEVICES.
    uuids = {0: "bbbb", 1: "GPU-aaaa"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))
    with caplog.at_level(logging.WARNING):
        telemetry = GpuTelemetry({"target": [torch.device("cuda:0")], "drafter": [torch.device("cuda:1")]})
        first, second = telemetry.read(), telemetry.read()
    assert first["gpu/cuda0/util_pct"] == 30 and first["gpu/cuda1/util_pct"] == 10
    assert first["gpu/target/util_pct"] == 30 and first["gpu/drafter/temp_c"] == 50
    assert first["gpu/cuda1/mem_used_gb"] == pytest.approx(10)
    assert not any("power" in k for k in first) and first == second
    assert len([r for r in caplog.records if "power_w" in r.message]) == 1
    # cuda:0 (NVML's bbbb) holds two more processes than this run: said once, counted every tick.
    assert first["gpu/cuda0/processes"] == 3 and first["gpu/cuda1/processes"] == 1
    shared = [r.message for r in caplog.records if "take turns" in r.message]
    assert len(shared) == 1 and shared[0].startswith("monitor: cuda:0 runs 3 processes (NVML)")


def test_telemetry_switch_turns_nvml_off(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml("nvmlDeviceGetPowerUsage"))
    telemetry = GpuTelemetry({"target": [torch.device("cuda:0")]}, enabled=False)
    assert telemetry.nvml is None and telemetry.read() == {}


def test_the_monitor_ticks_between_the_prompts_of_a_periodic_evaluation(make_cfg):
    """An evaluation can take minutes while the async pipeline trains on: the monitor keeps
    ticking between its prompts, so curves and the progress bar do not freeze."""
    run = build_run(make_cfg(["train.total_steps=4", "eval.every_steps=2", "eval.periodic_num_prompts=3"]))
    trainer, inside, ticks_inside = run.trainer, [False], []
    real_run_pending, real_tick = trainer.periodic_eval.run_pending, trainer.monitor.maybe_tick

    def run_pending(**kwargs):
        inside[0] = True
        ticks_inside.append(0)
        try:
            return real_run_pending(**kwargs)
        finally:
            inside[0] = False

    def maybe_tick(*args, **kwargs):
        if inside[0]:
            ticks_inside[-1] += 1
        return real_tick(*args, **kwargs)

    trainer.periodic_eval.run_pending = run_pending
    trainer.monitor.maybe_tick = maybe_tick
    run.execute()
    evaluations = [n for n in ticks_inside if n]  # run_pending returns at once with no snapshot
    assert len(evaluations) == 2 and all(n >= 3 for n in evaluations), ticks_inside


class ScriptedProbe:
    """A pipeline whose drafters have trained `samples` so far and publish one log window per
    `publish()`: the monitor's view of a run, tick by tick, without a run."""

    def __init__(self):
        self.samples, self.windows, self.step = 0.0, [], 0
        self.device_s = {"target0": 0.0, "drafter0": 0.0}
        self.drafter_wait_s = 0.0

    def publish(
        self, steps: int, samples: float, target_s: float = 0.0, drafter_s: float = 0.0, wait_s: float = 0.0
    ) -> None:
        """`steps` more batches (one per step, both roles), their device seconds per role."""
        self.step += steps
        self.samples += samples
        self.device_s["target0"] += target_s
        self.device_s["drafter0"] += drafter_s
        self.drafter_wait_s += wait_s
        self.windows.append([types.SimpleNamespace(end_step=self.step)])

    def completed_windows(self, wait: bool):
        done, self.windows = self.windows, []
        return done

    def pipeline_stats(self) -> dict[str, float]:
        stats = {"count/drafter0_samples": self.samples, "count/drafter0_tokens": 100 * self.samples}
        for name, seconds in self.device_s.items():
            stats[f"count/{name}_timed_batches"] = float(self.step)
            stats[f"worker/{name}_compute_total_s"] = seconds
        stats["worker/drafter0_wait_total_s"] = self.drafter_wait_s
        return stats

    def role_devices(self):
        return {}


def test_steady_throughput_leaves_out_start_up_and_the_tail(monkeypatch):
    """summary.json's samples/s: from the first log window's tick to the last periodic tick.
    Start-up (compiles) comes before the first window; the tail after the last periodic tick
    runs faster than the steady state (the target is done: its drafter no longer shares the
    GPU), so a short run must not count it; a run with no periodic tick after its first
    window's is measured to the final tick."""
    from dflash.monitor import monitor as monitor_module

    now = [0.0]
    monkeypatch.setattr(monitor_module.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(monitor_module, "train_metrics", lambda groups: {})

    def run(ticks: list[tuple[float, float, bool]]) -> dict[str, float]:
        probe = ScriptedProbe()
        now[0] = 0.0  # the run starts
        monitor = monitor_module.Monitor(
            sinks=[], probe=probe, total_steps=40, interval_s=5.0, telemetry=False, cuda_stats=False
        )
        for at, samples, final in ticks:
            now[0] = at
            probe.publish(steps=10, samples=samples)
            monitor.maybe_tick(wait=final, final=final)
        return monitor.steady_throughput()

    # Start-up until t=60 (40 samples then), steady 4 samples/s, a tail at 8 samples/s.
    steady = run([(60.0, 40, False), (65.0, 20, False), (70.0, 20, False), (72.0, 16, True)])
    assert steady["perf/samples_per_s"] == pytest.approx(4.0)
    assert steady["perf/tokens_per_s"] == pytest.approx(400.0)
    # Only the first window's tick and the final one: the final one it is.
    assert run([(60.0, 40, False), (70.0, 40, True)])["perf/samples_per_s"] == pytest.approx(4.0)
    # Every step done before the first window's tick: nothing to measure.
    assert run([(60.0, 40, True)]) == {}


def test_run_summary_role_times_leave_out_the_compiling_first_steps(monkeypatch):
    """The summary's per-batch device times and busy shares come from the steady window (as its
    samples/s): a first drafter step whose device span holds 75 s of compilation would otherwise
    double a 40-step run's drafter time per batch (the paper_b16 run on 2 H200s: 1036 ms whole-
    run against ~515 ms steady) and skew the split advice built on it."""
    from dflash.monitor import monitor as monitor_module
    from dflash.pipeline.roles import role_times

    now = [0.0]
    monkeypatch.setattr(monitor_module.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(monitor_module, "train_metrics", lambda groups: {})
    probe = ScriptedProbe()
    monitor = monitor_module.Monitor(
        sinks=[], probe=probe, total_steps=40, interval_s=5.0, telemetry=False, cuda_stats=False
    )
    # First window: 10 steps, the first of them compiling (75 s inside the drafter's span).
    now[0] = 85.0
    probe.publish(steps=10, samples=40, target_s=10 * 0.25, drafter_s=75.0 + 10 * 0.5)
    monitor.maybe_tick()
    for at in (90.0, 95.0):  # steady: 10 batches per 5 s, target 0.25 s and drafter 0.5 s each
        now[0] = at
        probe.publish(steps=10, samples=40, target_s=2.5, drafter_s=5.0, wait_s=0.5)
        monitor.maybe_tick()
    roles = monitor.steady_roles()
    assert roles["roles/target_s_per_batch"] == pytest.approx(0.25)
    assert roles["roles/drafter_s_per_batch"] == pytest.approx(0.5)
    assert roles["roles/target_busy_frac"] == pytest.approx(0.5)
    assert roles["roles/drafter_busy_frac"] == pytest.approx(1.0)
    assert roles["roles/data_wait_frac"] == pytest.approx(0.1)
    times = role_times(roles)
    assert times.best_num_targets(8) == 3  # 3 / 0.25 = 12 vs 5 / 0.5 = 10 batches/s

    # No steady window (the run ended within its first window): nothing, and the summary keeps
    # the whole-run figures.
    short = monitor_module.Monitor(
        sinks=[], probe=ScriptedProbe(), total_steps=10, interval_s=5.0, telemetry=False, cuda_stats=False
    )
    assert short.steady_roles() == {}


def test_drafter_totals_sum_every_replica_and_match_the_count_name_exactly():
    """`timed_batches` (the batches a worker's device time covers) must not count as `batches`."""
    from dflash.pipeline.counters import drafter_totals

    stats = {
        "count/drafter0_batches": 3.0,
        "count/drafter0_timed_batches": 2.0,
        "count/drafter1_batches": 4.0,
        "count/target0_batches": 9.0,
        "count/drafter0_samples": 5.0,
    }
    assert drafter_totals(stats, "batches") == 7.0
    assert drafter_totals(stats, "samples") == 5.0


def test_the_run_summary_takes_the_steady_window_role_figures_over_the_whole_runs(monkeypatch):
    """Trainer.role_summary (what summary.json reports): the monitor's steady window when the
    run had one, the whole run's counters (compilation included) when it did not."""
    import torch

    from dflash.pipeline import counters as counters_module
    from dflash.trainer.lifecycle import Trainer

    clock = iter([0.0, 3.0, 3.0, 4.0])  # a target batch of 3 s (it compiled), a drafter one of 1 s
    monkeypatch.setattr(counters_module.time, "perf_counter", lambda: next(clock))
    batch = types.SimpleNamespace(plan=types.SimpleNamespace(sample_ids=[0]), real_tokens=8)
    cpu = torch.device("cpu")
    whole_run = counters_module.WorkCounters("target0"), counters_module.WorkCounters("drafter0")
    for counters in whole_run:
        span = counters_module.DeviceSpan.start(cpu).stop()
        counters.record(batch, waited_s=0.0, busy_s=0.0, span=span)
    steady = {"roles/target_s_per_batch": 0.25, "roles/drafter_s_per_batch": 0.5}

    def trainer(window: dict[str, float]):
        return types.SimpleNamespace(
            monitor=types.SimpleNamespace(steady_roles=lambda: window),
            _role_counters=lambda: ([whole_run[0]], [whole_run[1]]),
            train_wall_s=10.0,
        )

    assert Trainer.role_summary(trainer(steady)) == steady
    fallback = Trainer.role_summary(trainer({}))
    assert fallback["roles/target_s_per_batch"] == pytest.approx(3.0)
    assert fallback["roles/drafter_s_per_batch"] == pytest.approx(1.0)
    assert fallback["roles/target_busy_frac"] == pytest.approx(0.3)


def test_the_run_summary_gives_each_devices_largest_peak_across_ticks(monkeypatch):
    """The allocator's peak is reset at every tick (each row logs its window's own), so the run's
    peak per device is the largest any tick read; the summary prints it per device (what a user
    sizes a target against: an FP8 80B target beside its drafter on one GPU)."""
    from dflash.monitor import monitor as monitor_module
    from dflash.run.runner import format_summary

    now = [0.0]
    monkeypatch.setattr(monitor_module.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(monitor_module, "train_metrics", lambda groups: {})
    peaks = iter([{0: 80.5, 1: 20.0}, {0: 92.25, 1: 18.0}, {0: 85.0, 1: 21.5}])

    def allocator(devices):
        window = next(peaks)
        return {f"cuda/cuda{i}/peak_allocated_gb": gb for i, gb in window.items()} | {"cuda/cuda0/ooms": 0.0}

    monkeypatch.setattr(monitor_module, "cuda_allocator_stats", allocator)
    monitor = monitor_module.Monitor(
        sinks=[], probe=ScriptedProbe(), total_steps=30, interval_s=5.0, telemetry=False, cuda_stats=True
    )
    monitor.cuda_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    for at in (5.0, 10.0, 15.0):
        now[0] = at
        monitor.maybe_tick()
    assert monitor.peak_allocated_gb == {"cuda0": 92.25, "cuda1": 21.5}
    summary = {
        "run_dir": "r",
        "checkpoint": "c",
        "steps": 30,
        "wall_s": 1.0,
        "pipeline": "async",
        "train/loss_first_window": 1.0,
        "train/loss": 0.5,
        "train/acc_first_window": 0.0,
        "train/acc": 0.5,
        "train/tau_sim": 1.0,
        "train/tau_block": 1.0,
        "train/tau_decode": 1.0,
        **{f"memory/{d}_peak_allocated_gb": gb for d, gb in monitor.peak_allocated_gb.items()},
    }
    assert "peak memory       cuda0 92.2 GB, cuda1 21.5 GB allocated" in format_summary(summary)


def test_a_target_bound_run_names_the_faster_target_settings_it_left_off():
    """The split advice follows the target path the run measured: when the target is the slower
    role and ran without the faster options for its kind (fused experts for MoE; the compiled
    stack, one graph per layer kind for MoE and hybrid stacks), the summary names them."""
    from dflash.config.schema import CompileScope, ExpertsKind, TargetConfig
    from dflash.pipeline.roles import role_lines
    from dflash.target.model import faster_target_settings
    from tests.conftest import tiny_config

    plain = TargetConfig(name="t")
    fast = TargetConfig(name="t", experts=ExpertsKind.fused, compile=True, compile_scope=CompileScope.layers)
    hybrid_moe, hybrid, dense = tiny_config("qwen3_next"), tiny_config("qwen3_5"), tiny_config("qwen3")
    assert faster_target_settings(plain, hybrid_moe) == [
        "target.experts=fused",
        "target.compile=true",
        "target.compile_scope=layers",
    ]
    assert faster_target_settings(plain, hybrid) == ["target.compile=true", "target.compile_scope=layers"]
    assert faster_target_settings(plain, dense) == ["target.compile=true"]
    assert faster_target_settings(fast, hybrid_moe) == faster_target_settings(fast, dense) == []
    presets = TargetConfig(
        name="t", experts=ExpertsKind.auto, compile=None, compile_scope=CompileScope.layers
    )
    assert faster_target_settings(presets, hybrid_moe) == []  # the hybrid/MoE presets' choices, on CUDA

    summary = {
        "replicas": 1, "node_gpus": 1, "roles/target_busy_frac": 1.0, "roles/drafter_busy_frac": 0.47,
        "roles/data_wait_frac": 0.95, "roles/target_s_per_batch": 1.088, "roles/drafter_s_per_batch": 0.513,
        "target_faster_settings": faster_target_settings(plain, hybrid_moe),
    }  # fmt: skip
    hint = [line for line in role_lines(summary) if line.startswith("faster target")]
    assert hint == [
        "faster target     the target is the slower role and ran without target.experts=fused "
        "target.compile=true target.compile_scope=layers (docs/configuration.md): with them it "
        "needs fewer of the split's GPUs"
    ]
    drafter_bound = {**summary, "roles/target_s_per_batch": 0.2}
    assert not [line for line in role_lines(drafter_bound) if line.startswith("faster target")]


# -- dflash-report: every variant's own figures drawn, no blank panel ---------------------------


def variant_rows(variant: str, steps: int = 4) -> list[dict]:
    """metrics.jsonl rows of a CPU run of `variant` (no gpu/ or queue/ families): its train/ figures
    as the step computes them (loss.objective_figures over the variant's metric fields), with
    an evaluation at the last step."""
    import numpy as np

    from dflash.step.loss import objective_figures
    from dflash.step.metrics import MetricLayout
    from dflash.step.variant_registry import registered_variants

    rng = np.random.default_rng([steps, len(variant)])
    layout = MetricLayout(block_size=4, num_buckets=2, variant=registered_variants()[variant]())
    written = []
    for step in range(1, steps + 1):
        sums: dict = {}
        for field in layout.fields:
            width = layout[field.name].stop - layout[field.name].start
            values = (rng.uniform(1.0, 2.0, width) * (4.0 if field.name == "counted" else 1.0)).tolist()
            sums[field.name] = values if field.width != "one" else values[0]
        figures = objective_figures(sums, layout.variant)
        written.append(
            {"step": step, **{f"train/{k}": v for k, v in figures.items()}, "train/grad_norm": 1.0}
        )
    written.append({"step": steps, "eval/tau": 2.0, "eval/heldout/tau": 2.0, "eval/accept_len_1_frac": 1.0})
    return written


def report_figures(tmp_path: Path, monkeypatch, rows: list[dict]) -> dict[str, object]:
    """dflash-report on a run dir holding `rows`: its figures, by the name of the file written."""
    from matplotlib.figure import Figure

    from dflash.tools import report

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    figures: dict[str, object] = {}
    real_savefig = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        figures[Path(path).stem] = fig
        return real_savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    report.main([str(run_dir)])
    assert {f"{name}.png" for name in figures} <= {p.name for p in (run_dir / "report").iterdir()}
    return figures


@pytest.mark.parametrize("variant", ["dspark", "dflash2"])
def test_the_report_draws_each_variant_figure_and_no_blank_panel(variant, tmp_path, monkeypatch):
    from dflash.step.variant_registry import registered_variants
    from dflash.tools.report import has_points

    figure_names = registered_variants()[variant].figure_names
    figures = report_figures(tmp_path, monkeypatch, variant_rows(variant))
    page = figures["variant_figures"]
    drawn = {line.get_label() for ax in page.axes for line in ax.lines if has_points(ax)}
    titles = {ax.get_title() for ax in page.axes}
    for name in figure_names:  # each of the variant's figures, on a panel of its kind
        assert f"train/{name}" in drawn, (name, sorted(drawn))
    if variant == "dspark":  # per-position families: one panel each, values against the position
        assert {"accept by block position", "confidence by block position"} <= titles
    own = {k for k in variant_rows(variant)[0] if k.startswith("train/")} - set(variant_rows("dflash")[0])
    positions = {k for k in own if "_pos_" in k}
    assert own - positions <= drawn  # every figure of the rows, none left out
    for name, fig in figures.items():
        for ax in fig.axes:  # every panel holds data, or says why it has none
            assert has_points(ax) or [t.get_text() for t in ax.texts], (name, ax.get_title())
    gpu_panels = figures["gpus"].axes
    assert all(t.get_text() == "no NVML telemetry in this run" for ax in gpu_panels for t in ax.texts)
    report_md = (tmp_path / "run" / "report" / "report.md").read_text()
    assert f"| train/{figure_names[-1]} |" in report_md and "](variant_figures.png)" in report_md


def test_a_dflash_run_has_no_variant_page(tmp_path, monkeypatch):
    figures = report_figures(tmp_path, monkeypatch, variant_rows("dflash"))
    assert "variant_figures" not in figures and "loss_accuracy" in figures
