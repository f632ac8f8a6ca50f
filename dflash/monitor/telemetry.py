"""Device telemetry for the monitor: NVML (`gpu/`) and the CUDA caching allocator (`cuda/`).

Both are read only from the monitor thread and cost the GPUs nothing: NVML queries the driver,
and allocator statistics are host-side counters. NVML numbers devices its own way and ignores
CUDA_VISIBLE_DEVICES, so CUDA devices are matched to NVML handles by UUID. Without NVML, a GPU,
or support for a field, that metric is left out after one warning; telemetry never fails a run.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# name -> (reader, scale); readers take (pynvml, handle).
_NVML_FIELDS = {
    "util_pct": (lambda nv, h: nv.nvmlDeviceGetUtilizationRates(h).gpu, 1.0),
    "mem_used_gb": (lambda nv, h: nv.nvmlDeviceGetMemoryInfo(h).used, 1e-9),
    "power_w": (lambda nv, h: nv.nvmlDeviceGetPowerUsage(h), 1e-3),
    "temp_c": (lambda nv, h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), 1.0),
    "sm_clock_mhz": (lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 1.0),
    "throttle_reasons": (lambda nv, h: nv.nvmlDeviceGetCurrentClocksEventReasons(h), 1.0),
    # Processes with a CUDA context on the device, this one included: more than one means the
    # GPU is time-sliced between them, and this run's throughput is not its own alone.
    "processes": (lambda nv, h: len(nv.nvmlDeviceGetComputeRunningProcesses(h)), 1.0),
}


class GpuTelemetry:
    """`gpu/cuda{i}/<field>` per device and `gpu/<role>/<field>` averaged over each role."""

    def __init__(self, role_devices: dict[str, list[torch.device]], enabled: bool = True):
        self.roles = {
            role: sorted({d.index or 0 for d in devices if d.type == "cuda"})
            for role, devices in role_devices.items()
        }
        self.handles: dict[int, object] = {}
        self.unsupported: set[str] = set()
        self.shared_warned: set[int] = set()  # devices already reported as shared
        self.nvml = None
        if not enabled or not any(self.roles.values()):
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # missing library, no driver: all mean "no telemetry"
            log.warning("monitor: NVML unavailable (%s); gpu/ metrics are left out", exc)
            return
        self.nvml = pynvml
        for index in sorted({i for ids in self.roles.values() for i in ids}):
            try:
                uuid = str(torch.cuda.get_device_properties(index).uuid)
                uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
                self.handles[index] = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except Exception as exc:
                log.warning(
                    "monitor: no NVML handle for cuda:%d (%s); its gpu/ metrics are left out", index, exc
                )

    def read(self) -> dict[str, float]:
        if self.nvml is None:
            return {}
        per_device: dict[int, dict[str, float]] = {}
        for index, handle in self.handles.items():
            values = per_device.setdefault(index, {})
            for name, (reader, scale) in _NVML_FIELDS.items():
                if name in self.unsupported:
                    continue
                try:
                    values[name] = float(reader(self.nvml, handle)) * scale
                except Exception as exc:
                    self.unsupported.add(name)
                    log.warning("monitor: NVML field %s unsupported (%s); left out from now on", name, exc)
        for index, values in per_device.items():
            if values.get("processes", 0) > 1 and index not in self.shared_warned:
                self.shared_warned.add(index)
                log.warning(
                    "monitor: cuda:%d runs %d processes (NVML); they take turns on it, so this run's "
                    "throughput and busy figures are not its own alone",
                    index,
                    int(values["processes"]),
                )
        metrics = {f"gpu/cuda{i}/{k}": v for i, values in per_device.items() for k, v in values.items()}
        for role, indices in self.roles.items():
            fields = {k for i in indices for k in per_device.get(i, {})}
            for name in fields:
                samples = [per_device[i][name] for i in indices if name in per_device.get(i, {})]
                metrics[f"gpu/{role}/{name}"] = sum(samples) / len(samples)
        return metrics

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.nvml = None


def cuda_allocator_stats(devices: list[torch.device]) -> dict[str, float]:
    """Allocated / reserved / window peak (reset after reading) / alloc retries / OOMs per device."""
    metrics: dict[str, float] = {}
    for index in sorted({d.index or 0 for d in devices if d.type == "cuda"}):
        stats = torch.cuda.memory_stats(index)
        prefix = f"cuda/cuda{index}"
        metrics[f"{prefix}/allocated_gb"] = stats.get("allocated_bytes.all.current", 0) / 1e9
        metrics[f"{prefix}/reserved_gb"] = stats.get("reserved_bytes.all.current", 0) / 1e9
        metrics[f"{prefix}/peak_allocated_gb"] = stats.get("allocated_bytes.all.peak", 0) / 1e9
        metrics[f"{prefix}/alloc_retries"] = float(stats.get("num_alloc_retries", 0))
        metrics[f"{prefix}/ooms"] = float(stats.get("num_ooms", 0))
        torch.cuda.reset_peak_memory_stats(index)  # the next tick reports its own window's peak
    return metrics
