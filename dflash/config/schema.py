"""The root config (`Config`) and its registration in Hydra's ConfigStore.

`conf/config.yaml` lists `dflash_schema` first in its defaults, so every YAML file and every
command-line override is merged into these dataclasses: an unknown key, a wrong type or an
unknown enum value fails at compose time with the dotted key in the message.

Each config group's dataclasses sit in a module of their own beside this one (target_schema,
drafter_schema, data_schema, component_schema, variant_schema, run_schema, eval_schema,
regen_schema), field declarations with their one-line meanings, read beside conf/<group>/. This
module composes them into the root, registers every component option, and re-exports every
name but the built-in variants' own options (variant_schema.py lists them in BUILT_IN_VARIANTS),
so `from dflash.config.schema import X` serves for the others.

This module and the group modules import only the standard library, omegaconf and hydra (no
torch), so that `dflash-train --help`, `--cfg job` and tab completion stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dflash.config.component_schema import (
    AdamWConfig,
    AsyncPipelineConfig,
    ConstantLrScheduleConfig,
    CosineLrScheduleConfig,
    DPaceLossConfig,
    FeatureNoiseConfig,
    InterleaveSchedulerConfig,
    LossConfig,
    LrScheduleConfig,
    MaskRampNoiseConfig,
    MonitorConfig,
    NoiseConfig,
    NoNoiseConfig,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    ShuffleSchedulerConfig,
    SyncPipelineConfig,
    pipeline_name,
)
from dflash.config.data_schema import (
    PACKING_KEYS,
    ConversationLayoutConfig,
    DataConfig,
    DataKind,
    SyntheticText,
)
from dflash.config.drafter_schema import (
    AttentionKind,
    DrafterConfig,
    LayerType,
)
from dflash.config.eval_schema import (
    EvalConfig,
    VerifyRule,
)
from dflash.config.regen_schema import (
    RegenBackend,
    RegenConfig,
    SamplingConfig,
)
from dflash.config.run_schema import (
    CheckpointConfig,
    DebugConfig,
    DeviceKind,
    GpuConfig,
    LoggerConfig,
    PathsConfig,
    TrainConfig,
)
from dflash.config.target_schema import (
    CompileScope,
    ExpertsKind,
    ExpertsTilingConfig,
    KernelTilingConfig,
    TargetConfig,
)
from dflash.config.variant_schema import (
    BUILT_IN_VARIANTS,
    FusedTerms,
    MarkovHeadType,
    VariantConfig,
)

__all__ = [
    "AdamWConfig",
    "AsyncPipelineConfig",
    "AttentionKind",
    "COMPONENT_OPTIONS",
    "CheckpointConfig",
    "CompileScope",
    "Config",
    "ConstantLrScheduleConfig",
    "ConversationLayoutConfig",
    "CosineLrScheduleConfig",
    "DataConfig",
    "DataKind",
    "DebugConfig",
    "DeviceKind",
    "DPaceLossConfig",
    "DrafterConfig",
    "EvalConfig",
    "ExpertsKind",
    "ExpertsTilingConfig",
    "FeatureNoiseConfig",
    "FusedTerms",
    "GpuConfig",
    "InterleaveSchedulerConfig",
    "KernelTilingConfig",
    "LayerType",
    "LoggerConfig",
    "LossConfig",
    "LrScheduleConfig",
    "MarkovHeadType",
    "MaskRampNoiseConfig",
    "MonitorConfig",
    "NoNoiseConfig",
    "NoiseConfig",
    "OptimizerConfig",
    "PACKING_KEYS",
    "PathsConfig",
    "PipelineConfig",
    "RegenBackend",
    "RegenConfig",
    "SamplingConfig",
    "SchedulerConfig",
    "ShuffleSchedulerConfig",
    "SyncPipelineConfig",
    "SyntheticText",
    "TargetConfig",
    "TrainConfig",
    "VariantConfig",
    "VerifyRule",
    "default_cache_dir",
    "pipeline_name",
    "register_configs",
]


@dataclass
class Config:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    variant: VariantConfig = field(default_factory=VariantConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    # A checkpoint directory to continue from (same batches, same losses).
    resume: Optional[str] = None
    # resume= onto training data other than the checkpoint's (other files or contents, another
    # template, appended samples) is refused, naming what changed; true continues on it anyway.
    resume_changed_data: bool = False
    # dflash-eval: the drafter to evaluate, a dflash checkpoint directory (whose run config then
    # supplies the target, unless target is overridden) or any z-lab-layout export.
    ckpt: Optional[str] = None
    # The summary metric the task function returns (what a Hydra sweeper optimizes).
    objective: str = "eval/tau"
    # Training callbacks, name -> {_target_: a class, its keyword arguments}
    # (dflash/monitor/callbacks.py, docs/extending.md): +callbacks.mine._target_=my_module.Mine
    callbacks: dict[str, Any] = field(default_factory=dict)


# The component schemas each option file of conf/<group>/ starts from (`defaults:
# [/schema/<group>/<option>@_here_]`): stored apart from the options, so they are neither listed nor
# selectable as options of the group.
COMPONENT_OPTIONS: dict[str, dict[str, type]] = {
    "scheduler": {"interleave": InterleaveSchedulerConfig, "shuffle": ShuffleSchedulerConfig},
    "optimizer": {"adamw": AdamWConfig},
    "lr_schedule": {"cosine": CosineLrScheduleConfig, "constant": ConstantLrScheduleConfig},
    "loss": {"default": LossConfig, "dpace": DPaceLossConfig},
    # The built-in variants' (dflash/config/variant_schema.py); a plug-in's enters with
    # `register_variant` (dflash/step/variant_registry.py).
    "variant": {variant.name: variant.options for variant in BUILT_IN_VARIANTS},
    "noise": {"none": NoNoiseConfig, "mask_ramp": MaskRampNoiseConfig, "feature": FeatureNoiseConfig},
    "pipeline": {"sync": SyncPipelineConfig, "async": AsyncPipelineConfig},
    "monitor": {"default": MonitorConfig},
}


def default_cache_dir() -> str:
    """paths.cache_dir's default: $DFLASH_CACHE_DIR, else ~/.cache/dflash. (OmegaConf resolves an
    `oc.env` default even when the variable is set, so HOME would be required by every run.)"""
    import os

    if os.environ.get("DFLASH_CACHE_DIR"):
        return os.path.expanduser(os.environ["DFLASH_CACHE_DIR"])
    if not os.environ.get("HOME"):
        raise ValueError(
            "paths.cache_dir: neither DFLASH_CACHE_DIR nor HOME is set; set one, or paths.cache_dir=DIR"
        )
    return os.path.join(os.environ["HOME"], ".cache", "dflash")


def register_configs() -> None:
    """Register the root schemas; idempotent (Hydra's ConfigStore replaces same-name entries)."""
    from os import getpid

    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("dflash_cache_dir", default_cache_dir, replace=True)
    OmegaConf.register_new_resolver("dflash_pid", getpid, replace=True)  # default run dir names
    schema = OmegaConf.structured(Config)
    # Name -> entry maps the user fills: `eval.benchmarks={gsm8k: g.jsonl}` and a new sink or
    # callback must work without Hydra's `+` (the flag keeps Hydra's struct mode from refusing
    # the new names).
    for free_form in (schema.eval.benchmarks, schema.callbacks, schema.logger.sinks):
        OmegaConf.set_struct(free_form, False)
    store = ConfigStore.instance()
    store.store(name="dflash_schema", node=schema)
    store.store(name="dflash_regen_schema", node=RegenConfig)
    for group, options in COMPONENT_OPTIONS.items():
        for option, node in options.items():
            store.store(group=f"schema/{group}", name=option, node=node)
