"""The Monitor: every `monitor.interval_s`, on the main thread, rows of floats to the sinks.

It reads what the pipeline stages expose (completed metric windows, batch stats, queue depths,
per-worker counters), NVML telemetry and CUDA allocator stats. It never touches a device tensor:
windows arrive as host floats through pinned copies, everything else is host counters.

Each completed log window (every `logger.every_steps` steps) is one row at its own step, whatever
the tick cadence: step-exact comparisons (sync vs async, resume, two seeds) read the same rows.
`interval_s` sets how often telemetry is sampled (on the last window's row of the tick, or a row
of its own); `interval_s: 0` ticks as soon as a window completes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dflash.monitor.sinks import MetricSink
from dflash.monitor.telemetry import GpuTelemetry, cuda_allocator_stats
from dflash.monitor.train_metrics import NonFiniteTraining, train_metrics
from dflash.pipeline.counters import drafter_totals
from dflash.pipeline.roles import window_role_summary
from dflash.step.metrics import MetricWindow

log = logging.getLogger(__name__)


class PipelineProbe(Protocol):
    """What a trainer exposes to the monitor (host values only, cheap, thread-safe)."""

    def completed_windows(self, wait: bool) -> list[list[MetricWindow]]:
        """Log windows every replica has published, oldest first; one list of replicas each."""

    def pipeline_stats(self) -> dict[str, float]:
        """Instant values (batch/, queue/ depths) and cumulative counters (worker/*, *_s totals)."""

    def role_devices(self) -> dict[str, list[torch.device]]: ...


@dataclass(frozen=True)
class _Mark:
    time: float
    counters: dict[str, float]  # the probe's pipeline_stats() at that tick

    def total(self, name: str) -> float:
        return drafter_totals(self.counters, name)


@dataclass(kw_only=True)
class Monitor:
    """The config group `monitor`'s component, built with the run's sinks and the trainer (the
    probe): `interval_s` between ticks (0: one per log window), NVML `telemetry`, allocator
    `cuda_stats` (their meanings: MonitorConfig)."""

    sinks: list[MetricSink]
    probe: PipelineProbe
    total_steps: int
    interval_s: float = 10.0
    telemetry: bool = True
    cuda_stats: bool = True
    # Every tick that carried train metrics, as logged.
    history: list[dict[str, float]] = field(default_factory=list)
    # train/ metrics of each log window (every logger.every_steps steps), whatever the tick
    # cadence: step-based, so a run summary does not depend on how fast the machine is.
    window_history: list[dict[str, float]] = field(default_factory=list)
    # The largest allocation peak each CUDA device reached at any tick: the allocator's peak is
    # reset at every tick (each row logs its own window's), so the run's is kept here.
    peak_allocated_gb: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        roles = self.probe.role_devices()
        self.gpu = GpuTelemetry(roles, enabled=self.telemetry)
        self.cuda_devices = [d for devices in roles.values() for d in devices if d.type == "cuda"]
        self._last_tick = time.perf_counter()
        self._last_counters: dict[str, float] = {}
        # The pipeline's cumulative counters at the first tick that carried a train window, at
        # the latest periodic tick and at the final (forced) one: the run's steady throughput
        # and role times, without start-up and compilation (which happen before the first
        # window completes) and without the tail (see steady_throughput).
        self._first_mark: _Mark | None = None
        self._last_mark: _Mark | None = None
        self._final_mark: _Mark | None = None

    def maybe_tick(self, wait: bool = False, final: bool = False) -> None:
        """Tick if the interval has passed; cheap to call often. `final`: the run's last tick,
        taken whatever the interval (it closes the tail that `steady_throughput` leaves out)."""
        now = time.perf_counter()
        if not final and self.interval_s > 0 and now - self._last_tick < self.interval_s:
            return
        groups = self.probe.completed_windows(wait)
        if groups or final or self.interval_s > 0:
            self._tick(groups, final=final)

    def _tick(self, groups: list[list[MetricWindow]], final: bool = False) -> None:
        """One row per completed log window, at its own step, with that window's train/ metrics
        only (never merged with the next window, however late the tick): two runs of one seed
        log the same values at the same steps. The tick's telemetry (pipeline, queues, GPUs,
        allocator, sinks) rides on the last window's row, or on a row of its own."""
        now = time.perf_counter()
        elapsed = max(now - self._last_tick, 1e-9)
        self._last_tick = now
        rows = []
        for group in groups:
            row = train_metrics([group])
            self.window_history.append({"step": float(group[0].end_step), **row})
            rows.append((group[0].end_step, row))
        telemetry = self._pipeline_metrics(elapsed)
        if self.window_history:
            mark = _Mark(now, self._last_counters)
            self._first_mark = self._first_mark or mark
            if final:
                self._final_mark = mark
            else:
                self._last_mark = mark
        telemetry.update(self.gpu.read())
        if self.cuda_stats and self.cuda_devices:
            allocator = cuda_allocator_stats(self.cuda_devices)
            for key, value in allocator.items():
                if key.endswith("/peak_allocated_gb"):
                    device = key.split("/")[1]
                    self.peak_allocated_gb[device] = max(self.peak_allocated_gb.get(device, 0.0), value)
            telemetry.update(allocator)
        for sink in self.sinks:
            telemetry.update(getattr(sink, "health", dict)())
        if rows:
            rows[-1][1].update(telemetry)
        else:
            rows.append((int(self.history[-1]["step"]) if self.history else 0, telemetry))
        for step, row in rows:
            if "train/loss" in row:
                self.history.append({"step": float(step), **row})
            for sink in self.sinks:
                sink.log(row, step)
        bad = [(step, row["train/nonfinite_steps"]) for step, row in rows if row.get("train/nonfinite_steps")]
        if bad:
            step, count = bad[0]
            raise NonFiniteTraining(
                f"non-finite loss or gradient in {int(count)} step(s) of the log window ending at step "
                f"{step}: those updates were skipped, so the weights and every checkpoint hold no NaN "
                "(resume= from the last one); lower optimizer.lr, check the data, or find the op with "
                "debug=anomaly"
            )

    def _pipeline_metrics(self, elapsed: float) -> dict[str, float]:
        stats = self.probe.pipeline_stats()
        previous, self._last_counters = self._last_counters, dict(stats)
        metrics: dict[str, float] = {}
        for key, value in stats.items():
            if key.endswith("_total_s"):  # cumulative seconds -> share of this tick's wall time
                share = (value - previous.get(key, 0.0)) / elapsed
                metrics[key.removesuffix("_total_s") + "_frac"] = min(max(share, 0.0), 1.0)
            elif key.startswith("count/"):  # cumulative counts: logged as is, rates derived
                metrics["worker/" + key.removeprefix("count/")] = float(value)
            else:
                metrics[key] = float(value)
        delta = {k: stats[k] - previous.get(k, 0.0) for k in stats if k.startswith("count/")}
        drafters = sorted({k.split("/")[1].split("_")[0] for k in delta if k.startswith("count/drafter")})
        for name, rate in (
            ("tokens", "tokens_per_s"),
            ("samples", "samples_per_s"),
            ("anchors", "anchors_per_s"),
        ):
            metrics[f"perf/{rate}"] = sum(delta.get(f"count/{d}_{name}", 0.0) for d in drafters) / elapsed
        for name in ("tokens", "samples"):
            metrics[f"perf/{name}_total"] = drafter_totals(stats, name)
        waits = [metrics[f"worker/{d}_wait_frac"] for d in drafters if f"worker/{d}_wait_frac" in metrics]
        if waits:
            metrics["perf/data_wait_frac"] = sum(waits) / len(waits)
        for role in ("target", "drafter"):
            # Device time of the role's work per wall second, averaged over its devices.
            shares = [
                v
                for k, v in metrics.items()
                if k.startswith(f"worker/{role}") and k.endswith("_compute_frac")
            ]
            if shares:
                metrics[f"perf/{role}_busy_frac"] = sum(shares) / len(shares)
        return metrics

    def steady_throughput(self) -> dict[str, float]:
        """Samples and tokens per second from the first train window's tick to the last
        periodic tick (empty when the run was too short to have two such ticks).

        The final tick closes the tail, which runs faster than the steady state: the target
        workers run ahead of the drafters by their queues, so the last drafter steps run on a
        GPU the target no longer shares (one H200 doing both roles: 4.78 samples/s in every
        periodic tick of a 40-step run, 6.9 in its tail, 5.8 with the tail counted). A run with
        no periodic tick after its first window's is measured to the final tick."""
        window = self._steady_window()
        if window is None:
            return {}
        first, last = window
        seconds = last.time - first.time
        return {
            "perf/samples_per_s": (last.total("samples") - first.total("samples")) / seconds,
            "perf/tokens_per_s": (last.total("tokens") - first.total("tokens")) / seconds,
        }

    def steady_roles(self) -> dict[str, float]:
        """Each role's device time per batch, busy share and the drafters' data wait over the
        window of `steady_throughput` (empty without one: the run summary then reports whole-run
        figures, compilation included)."""
        window = self._steady_window()
        if window is None:
            return {}
        first, last = window
        return window_role_summary(first.counters, last.counters, last.time - first.time)

    def _steady_window(self) -> tuple[_Mark, _Mark] | None:
        first = self._first_mark
        if first is None:
            return None
        last = self._last_mark
        if last is None or last.total("samples") <= first.total("samples"):
            last = self._final_mark
        if last is None or last.time <= first.time or last.total("samples") <= first.total("samples"):
            return None  # every step finished before the first window's tick
        return first, last

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Rows outside the tick cadence (the final evaluation)."""
        for sink in self.sinks:
            sink.log(metrics, step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The run summary (what summary.json holds), to each sink that takes it (`log_summary`)."""
        for sink in self.sinks:
            hook = getattr(sink, "log_summary", None)
            if hook is not None:
                hook(dict(summary))

    def close(self, ok: bool) -> None:
        self.gpu.close()
        for sink in self.sinks:
            sink.close(ok)
