"""Running a built run: train, measure the held-out split, evaluate, write summary.json and
print the summary; the monitor and the process group are closed however it ends."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.config.schema import Config, DeviceKind, pipeline_name
from dflash.distributed import ProcessGroupInfo, visible_cuda_devices
from dflash.eval.evaluate import evaluate, planned_decodings
from dflash.eval.prompt_sets import PromptSet
from dflash.eval.results import lossless_line
from dflash.export.card import write_model_card
from dflash.monitor.callbacks import TrainingCallbacks
from dflash.pipeline.roles import role_lines
from dflash.run.inputs import eval_prompts_description
from dflash.run.record import replace_text
from dflash.step.variant_registry import registered_variants, variant_figure_names
from dflash.target.model import faster_target_settings
from dflash.torch_runtime.compile import CompileCounter
from dflash.trainer.checkpoint import LAST, checkpoint_behind_last, publish_last
from dflash.trainer.lifecycle import Trainer
from dflash.trainer.signals import StopRequested, stop_on_signals
from dflash.trainer.validation import Validation

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Run:
    cfg: Config
    run_dir: Path
    trainer: Trainer
    total_steps: int  # the LR schedule spans these
    process_group: ProcessGroupInfo
    eval_prompts: list[PromptSet]  # the end-of-training evaluation
    compiled: dict[str, CompileCounter] = field(default_factory=dict)  # per role: graphs compiled
    validation: Validation | None = None  # data.val_samples: measured before the final evaluation
    callbacks: TrainingCallbacks = field(default_factory=TrainingCallbacks)  # the `callbacks:` node

    def execute(self) -> dict[str, Any]:
        started = time.perf_counter()
        first_step = self.trainer.position.step  # > 0: resumed, and this process's figures start there
        ok = False
        try:
            self.callbacks.on_train_start(self.trainer)
            with torch.autograd.set_detect_anomaly(self.cfg.debug.detect_anomaly):
                self.trainer.run()
            stopped_after_training = self.trainer.stop_after_training
            if not self.process_group.is_main:
                if stopped_after_training is not None:
                    raise StopRequested(stopped_after_training)
                ok = True
                return {"rank": self.process_group.rank, "steps": self.trainer.position.step}
            # A signal now ends the evaluation, not the process; held until summary.json is
            # written, so a second Ctrl-C cannot break it off. One that came after the last
            # step has already asked for it.
            with stop_on_signals() as stop:
                if stopped_after_training is not None:
                    stop.request(stopped_after_training)
                val_metrics = {}
                if self.validation is not None:
                    val_metrics = self.validation.run(self.trainer.target, self.trainer.drafter)
                    self.trainer.monitor.log(val_metrics, self.trainer.position.step)
                report = evaluate(
                    self.trainer.target,
                    self.trainer.drafter,
                    self.eval_prompts,
                    self.cfg.eval,
                    timing=False,
                    should_stop=stop.is_set,
                )
                eval_metrics = report.metrics()
                self.trainer.monitor.log(eval_metrics, self.trainer.position.step)
                # What was decoded, named once for the summary and the card (not a metric).
                described = {**eval_metrics, "eval/prompts": eval_prompts_description(self.cfg.eval)}
                self._card_with_evaluation(described)
                self.callbacks.on_eval(self.trainer.position.step, eval_metrics)
                summary = self._summary(
                    {**val_metrics, **described},
                    wall_s=time.perf_counter() - started,
                    first_step=first_step,
                )
                summary["eval/interrupted"] = report.interrupted
                write_summary(self.run_dir / "summary.json", summary)
                self.trainer.monitor.log_summary(summary)
            print(format_summary(summary), flush=True)
            if report.interrupted:
                log.warning(
                    "stopped during the final evaluation after %d of %d prompt decodings: summary.json "
                    "holds what was evaluated; the training checkpoint is complete",
                    report.decodings(),
                    planned_decodings(self.eval_prompts, self.cfg.eval),
                )
            if report.interrupted or stopped_after_training is not None:
                raise StopRequested(stop.signum)
            self.callbacks.on_train_end(summary)
            ok = True
            return summary
        finally:
            self.trainer.monitor.close(ok)
            self.process_group.close()

    def _card_with_evaluation(self, eval_metrics: dict[str, float]) -> None:
        """The last checkpoint's model card, rewritten with the final evaluation's figures: in
        its step directory, then `last` published again with it."""
        settings = self.trainer.checkpoints
        last = settings.directory / LAST
        if settings.card is None or not last.is_dir():
            return
        facts = dataclasses.replace(settings.card, steps=self.trainer.position.step, evaluation=eval_metrics)
        checkpoint = checkpoint_behind_last(settings.directory)
        if checkpoint is None:  # `last` holds copies: its card alone changes
            write_model_card(last, facts)
            return
        write_model_card(checkpoint, facts, served_from=str(checkpoint.resolve()))
        publish_last(settings.directory, checkpoint)

    def _summary(self, eval_metrics: dict[str, float], *, wall_s: float, first_step: int) -> dict[str, Any]:
        """wall_s, the first window and the throughput are this process's: from `first_step`,
        the step a resumed run started from (recorded as resumed_from_step)."""
        history = self.trainer.monitor.window_history
        first, last = history[0], history[-1]
        return {
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.trainer.checkpoints.directory / LAST),
            "pipeline": pipeline_name(self.cfg.pipeline),
            "steps": self.trainer.position.step,
            **({"resumed_from_step": first_step} if first_step else {}),
            # milliseconds: a tiny run's first step can take under 0.05 s, which one decimal would read as 0
            "wall_s": round(wall_s, 3),
            **(
                {"first_step_s": round(self.trainer.first_step_s, 3)}
                if self.trainer.first_step_s is not None
                else {}
            ),
            "train/acc_first_window": first["train/acc"],
            "train/acc": last["train/acc"],
            "train/loss_first_window": first["train/loss"],
            "train/loss": last["train/loss"],
            "train/tau_sim": last["train/tau_sim"],
            "train/tau_block": last["train/tau_block"],
            "train/tau_decode": last["train/tau_decode"],
            # The variant's own figures (dflash/step/variant.py: figure_names)
            **{
                f"train/{name}": last[f"train/{name}"]
                for name in variant_figure_names()
                if f"train/{name}" in last
            },
            **({"val_samples": self.validation.num_samples} if self.validation is not None else {}),
            "replicas": len(self.trainer.role_devices()["drafter"]) * self.process_group.world_size,
            "replica_digest": self.trainer.replica_digest,
            "node_gpus": visible_cuda_devices() if self.cfg.gpu.device is DeviceKind.cuda else 0,
            **{f"{role}_compiled_graphs": counter.graphs for role, counter in self.compiled.items()},
            **(
                {
                    "target_faster_settings": faster_target_settings(
                        self.cfg.target, self.trainer.target.config
                    )
                }
                if self.cfg.gpu.device is DeviceKind.cuda
                else {}
            ),
            **self.trainer.monitor.steady_throughput(),
            **{
                f"memory/{device}_peak_allocated_gb": round(gb, 2)
                for device, gb in self.trainer.monitor.peak_allocated_gb.items()
            },
            **self.trainer.role_summary(),
            **eval_metrics,
        }


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Atomically: a reader (or the run record) sees the whole summary or none."""
    replace_text(path, json.dumps(summary, indent=2) + "\n")


# Why a summary figure can be undefined, by its name: each is a ratio over what a window (or the
# held-out split) counted, and a short run can count none (dflash/step/loss.py divides by zero
# into NaN); a variant names its own (dflash/step/variant.py: undefined_because). Figures not
# named are losses: NaN there means the loss itself was not finite.
UNDEFINED_BECAUSE = {
    **dict.fromkeys(("tau_block", "tau_decode"), "no block measured"),
    **dict.fromkeys(("acc", "acc_first_window"), "no supervised position"),
}


def undefined_because(name: str) -> str:
    for variant in registered_variants().values():
        if name in variant.undefined_because:
            return variant.undefined_because[name]
    return UNDEFINED_BECAUSE.get(name, "not finite")


def is_defined(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def figure(summary: dict[str, Any], key: str) -> str:
    """A summary figure to 3 decimals, or `n/a (why)` where it is undefined (never `nan`)."""
    value = summary.get(key)
    if is_defined(value):
        return f"{value:.3f}"
    if value is None:
        return "n/a (not measured)"
    return f"n/a ({undefined_because(key.rsplit('/', 1)[-1])})"


def format_summary(summary: dict[str, Any]) -> str:
    # A resumed run's first window is the first after the resume, not the run's first.
    resumed = summary.get("resumed_from_step")
    since = f" (from the first window after step {resumed})" if resumed else ""
    lines = [
        "",
        "=== dflash run summary ===",
        f"run dir           {summary['run_dir']}",
        f"drafter           {summary['checkpoint']}",
        _steps_line(summary),
        f"train loss        {figure(summary, 'train/loss_first_window')} -> {figure(summary, 'train/loss')}{since}",
        f"train accuracy    {figure(summary, 'train/acc_first_window')} -> {figure(summary, 'train/acc')}{since}",
        _tau_line(summary),
        *variant_summary_lines(summary),
    ]
    if "perf/samples_per_s" in summary:
        lines.append(
            f"throughput        {summary['perf/samples_per_s']:.2f} samples/s, {summary['perf/tokens_per_s']:.0f} tokens/s (after the first log window)"
        )
    lines += _memory_lines(summary)
    lines += _evaluation_lines(summary)
    lines.extend(role_lines(summary))
    return "\n".join(lines)


def variant_summary_lines(summary: dict[str, Any]) -> list[str]:
    """Each variant's own line, where the summary holds its figures: its `summary_key`
    (dflash/step/variant.py). Several variants share figure names (`ce`); the key is its own."""
    return [
        variant.summary_line(summary, figure, is_defined)
        for variant in registered_variants().values()
        if variant.summary_key is not None and variant.summary_key in summary
    ]


def _steps_line(summary: dict[str, Any]) -> str:
    resumed = summary.get("resumed_from_step")
    return (
        f"steps             {summary['steps']}  ("
        + (
            f"resumed at step {resumed}: {summary['wall_s']:.1f} s in this process"
            if resumed
            else f"{summary['wall_s']:.1f} s"
        )
        # With torch.compile the first step carries the graphs' compile: the wait a user sees.
        + (f", first step after {summary['first_step_s']:.1f} s" if "first_step_s" in summary else "")
        + f", pipeline={summary['pipeline']})"
    )


def _tau_line(summary: dict[str, Any]) -> str:
    return (
        f"tau (simulated)   {figure(summary, 'train/tau_sim')} (block runs {figure(summary, 'train/tau_block')},"
        f" as decoding meets them {figure(summary, 'train/tau_decode')})"
        + (
            f" on training batches; {figure(summary, 'val/tau_sim')} ({figure(summary, 'val/tau_block')},"
            f" {figure(summary, 'val/tau_decode')}) on {summary['val_samples']} held-out samples"
            if "val/tau_sim" in summary
            else ""
        )
    )


def _memory_lines(summary: dict[str, Any]) -> list[str]:
    peaks = {k: v for k, v in summary.items() if k.startswith("memory/") and k.endswith("_peak_allocated_gb")}
    if not peaks:
        return []
    return [
        "peak memory       "
        + ", ".join(
            f"{key.removeprefix('memory/').removesuffix('_peak_allocated_gb')} {gb:.1f} GB"
            for key, gb in sorted(peaks.items())
        )
        + " allocated at most, per device, up to the last training step"
    ]


def _evaluation_lines(summary: dict[str, Any]) -> list[str]:
    if "eval/tau" in summary:
        lines = [
            f"tau (spec decode) {summary['eval/tau']:.3f} over {int(summary['eval/num_prompts'])} "
            f"{summary.get('eval/prompts', 'prompts')}"
            + (" (evaluation interrupted)" if summary.get("eval/interrupted") else "")
        ]
    else:
        lines = ["tau (spec decode) not measured: the evaluation was interrupted before its first prompt"]
    if "eval/lossless_frac" in summary:
        lines.append(f"lossless          {lossless_line(summary)}")
    return lines
