"""The component groups' schemas (`scheduler`, `optimizer`, `lr_schedule`, `loss`, `noise`, `pipeline`,
`monitor`; the variants' are in variant_schema).

One structured config per option, naming the class or function it builds (`_target_`): the
launcher builds each with hydra.utils.instantiate (dflash/run/launch.py); a `_partial_` one gets
its runtime objects (the samples' lengths, the drafter's parameters, the trainer...) when it is
built. A user's own class is named the same way, by YAML or an override, and receives the
option's fields (docs/extending.md); no switch over the built-ins exists anywhere. Each option
file (conf/<group>/<option>.yaml) starts from its schema (`defaults:
[/schema/<group>/<option>@_here_]`), so a key of another option is refused at compose time
(noise=none has no `std`).

No torch here: see dflash/config/schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from dflash.config.bounds import at_least


@dataclass
class SchedulerConfig:
    """The batch order: `_target_` is a BatchPlanner class (dflash/data/scheduler.py), whose
    `order` sorts an epoch's batches; the batches' sizes are the data's (data.bucket_edges,
    data.tokens_per_batch, data.block_tokens_per_batch)."""

    _target_: str = MISSING
    _partial_: bool = True


@dataclass
class InterleaveSchedulerConfig(SchedulerConfig):
    _target_: str = "dflash.data.scheduler.InterleavePlanner"


@dataclass
class ShuffleSchedulerConfig(SchedulerConfig):
    _target_: str = "dflash.data.scheduler.ShufflePlanner"


@dataclass
class OptimizerConfig:
    """`_target_`: a torch optimizer class, built over the drafter's parameters. The step divides
    the gradients by the loss weight and clips them through the fused kernel's `grad_scale`
    input (no pass over the gradients), so the optimizer must be a fused one."""

    _target_: str = MISSING
    _partial_: bool = True
    lr: float = 6e-4
    fused: bool = True
    # The step's gradient-norm clip, applied inside the fused update (not an optimizer argument).
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.fused:
            raise ValueError(
                "optimizer.fused=false: the step divides and clips the gradients through a fused "
                "optimizer's grad_scale input, which an unfused one ignores"
            )
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        if not self.grad_clip > 0:
            raise ValueError(f"optimizer.grad_clip must be > 0, got {self.grad_clip}")


@dataclass
class AdamWConfig(OptimizerConfig):
    _target_: str = "torch.optim.AdamW"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {list(self.betas)}")
        # torch refuses these too, but only once the drafter is built, and without the key.
        for key in ("weight_decay", "eps"):
            at_least(f"optimizer.{key}", getattr(self, key), 0)
        super().__post_init__()


@dataclass
class LrScheduleConfig:
    """`_target_`: a function (optimizer, *, total_steps, warmup_ratio) -> an LR scheduler."""

    _target_: str = MISSING
    _partial_: bool = True
    warmup_ratio: float = 0.04

    def __post_init__(self) -> None:
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"lr_schedule.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")


@dataclass
class CosineLrScheduleConfig(LrScheduleConfig):
    _target_: str = "dflash.step.lr_schedule.cosine_with_warmup"


@dataclass
class ConstantLrScheduleConfig(LrScheduleConfig):
    _target_: str = "dflash.step.lr_schedule.constant_with_warmup"
    warmup_ratio: float = 0.0


@dataclass
class LossConfig:
    """`_target_`: the block loss (dflash/step/loss.py): its position weights and chunking."""

    _target_: str = "dflash.step.loss.BlockLoss"
    # Position weight w_k = exp(-(k-1)/gamma); paper: 7 for B=16, 5 for B=10, 4 for B=8.
    gamma: float = 7.0
    # Block positions per sample sent through the LM head at once, recomputed in backward;
    # bounds the logits memory to chunk x vocab floats per sample. 0: all positions at once.
    logits_chunk: int = 2048

    def __post_init__(self) -> None:
        if not self.gamma > 0:
            raise ValueError(f"loss.gamma must be > 0, got {self.gamma}")
        if self.logits_chunk < 0:
            raise ValueError(f"loss.logits_chunk must be >= 0 (0: no chunking), got {self.logits_chunk}")


@dataclass
class DPaceLossConfig(LossConfig):
    """loss=dpace (dflash/step/dpace.py): position weights from the drafter's confidence in each
    label; `gamma` stays for the drafter options that set it, unread."""

    _target_: str = "dflash.step.dpace.DPaceLoss"
    # Smoothing of the confidences toward 1, s = alpha + (1 - alpha) q; the references' 0.5.
    alpha: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"loss.alpha must be in (0, 1], got {self.alpha}")


@dataclass
class NoiseConfig:
    """`_target_`: a noise schedule (dflash/step/noise.py): per optimizer step, the share of
    block positions that keep their true token and the std of the feature noise."""

    _target_: str = MISSING


@dataclass
class NoNoiseConfig(NoiseConfig):
    _target_: str = "dflash.step.noise.NoNoise"


@dataclass
class MaskRampNoiseConfig(NoiseConfig):
    _target_: str = "dflash.step.noise.MaskRampNoise"
    # Share of non-anchor block positions that keep their true token at step 0 (ramps to 0).
    start: float = 0.5
    warmup_steps: int = 2000

    # A schedule that silently does nothing is the bug this group exists to avoid.
    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"noise=mask_ramp needs noise.warmup_steps >= 1, got {self.warmup_steps}")
        if not 0.0 < self.start <= 1.0:
            raise ValueError(f"noise=mask_ramp needs noise.start in (0, 1], got {self.start}")


@dataclass
class FeatureNoiseConfig(NoiseConfig):
    _target_: str = "dflash.step.noise.FeatureNoise"
    # Std of the Gaussian added to the fused context feature after warmup (ramps from 0).
    std: float = 0.05
    warmup_steps: int = 2000

    def __post_init__(self) -> None:
        if self.warmup_steps < 1:
            raise ValueError(f"noise=feature needs noise.warmup_steps >= 1, got {self.warmup_steps}")
        if not self.std > 0.0:
            raise ValueError(f"noise=feature needs noise.std > 0, got {self.std}")


@dataclass
class PipelineConfig:
    """`_target_`: the trainer (dflash/trainer/), built with the run's targets, step objects,
    dataset and planner."""

    _target_: str = MISSING
    _partial_: bool = True


@dataclass
class SyncPipelineConfig(PipelineConfig):
    _target_: str = "dflash.trainer.sync.SyncTrainer"


@dataclass
class AsyncPipelineConfig(PipelineConfig):
    _target_: str = "dflash.trainer.async_trainer.AsyncTrainer"
    # Packets of target features waiting for a drafter (producers block beyond it).
    hs_queue_size: int = 8
    # Collated batches waiting per target device.
    prefetch_depth: int = 4
    # Collate/pad/pin worker threads.
    num_workers: int = 2
    # Run every bucket's largest shape through the target before the clock starts.
    warmup: bool = True
    # How often the main thread collects metric windows and checks thread health.
    poll_interval_s: float = 0.05
    # How long threads get to stop after a failure or a stop request.
    shutdown_timeout_s: float = 10.0
    # A stop request waits for the step in hand (a first compile can take minutes); if it has
    # not ended after this many seconds, every pipeline thread's stack is logged once, so a step
    # that will never end (a compiler whose processes the signal killed) shows where it waits.
    stop_report_s: float = 300.0


def pipeline_name(node: PipelineConfig) -> str:
    """The `pipeline` option a node is (sync, async), or its `_target_` for a user's trainer."""
    if isinstance(node, SyncPipelineConfig):
        return "sync"
    if isinstance(node, AsyncPipelineConfig):
        return "async"
    return node._target_


@dataclass
class MonitorConfig:
    """`_target_`: the monitor (dflash/monitor/monitor.py), built with the sinks and the trainer."""

    _target_: str = "dflash.monitor.monitor.Monitor"
    _partial_: bool = True
    # Seconds between ticks (one flat dict of floats to every sink); 0: one tick per log window.
    interval_s: float = 10.0
    # NVML telemetry (gpu/): off is the escape hatch when the driver misbehaves.
    telemetry: bool = True
    # CUDA caching-allocator stats (cuda/), peaks reset per tick.
    cuda_stats: bool = True
