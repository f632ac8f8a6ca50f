"""logger.sinks.console: one readable line per log window above the progress bar."""

from __future__ import annotations

from dflash.monitor.sinks.progress import ProgressSink
from dflash.step.metrics import metric_fields
from dflash.step.variant_registry import registered_variants


class ConsoleSink(ProgressSink):
    """The progress bar plus one readable line per log window, printed above the bar (tqdm.write:
    lines never tear it)."""

    FIGURES = ("train/loss", "train/acc", "train/tau_sim", "train/tau_decode")
    AFTER = ("train/lr", "perf/tokens_per_s", "perf/data_wait_frac", "queue/hs_fill", "gpu/drafter/util_pct")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The line's keys: the objective's figures, each variant's `console_figures` (absent from
        another variant's rows, so not printed there), each metric field marked `console`, the rest."""
        variants = tuple(
            f"train/{name}" for variant in registered_variants().values() for name in variant.console_figures
        )
        fields = tuple(f"train/{field.name}" for field in metric_fields() if field.console)
        return cls.FIGURES + variants + fields + cls.AFTER

    def log(self, metrics: dict[str, float], step: int) -> None:
        if "train/loss" not in metrics:
            return  # telemetry-only rows, and evaluation rows (printed in the run summary)
        super().log(metrics, step)
        parts = [f"{k.split('/', 1)[-1]}={metrics[k]:.4g}" for k in self.keys() if k in metrics]
        self.bar.write(f"step {step:>6}  " + "  ".join(parts))
