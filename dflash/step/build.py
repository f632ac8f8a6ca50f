"""The drafter, its optimizer, LR schedule, noise, loss and step object, each from its own
config node plus the runtime objects it needs (the components are built with
hydra.utils.instantiate: dflash/config/components.py).

The launcher (dflash/run/launch.py) and the tools that build a step outside a run
(scripts/bench_step.py, scripts/check_fast_path.py) call these through `launch.step_fn_for`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3Config

from dflash.config.components import build
from dflash.config.schema import (
    AttentionKind,
    DrafterConfig,
    LossConfig,
    LrScheduleConfig,
    NoiseConfig,
    OptimizerConfig,
    VariantConfig,
)
from dflash.drafters.backbone import DFlashDrafter, drafter_config
from dflash.drafters.drafter_registry import drafter_class_for
from dflash.step.loss import BlockLoss
from dflash.step.noise import NoiseSchedule
from dflash.step.step import BlockSettings, DrafterStep
from dflash.step.variant import DFlashVariant
from dflash.target.target_head import TargetHead


def build_variant(node: VariantConfig | None) -> DFlashVariant:
    """The `variant` node's component (None: plain DFlash)."""
    return DFlashVariant() if node is None else build(node, "variant")


def run_drafter_config(
    cfg: DrafterConfig, target_config: Any, layer_ids: list[int], variant: DFlashVariant
) -> Qwen3Config:
    """The config of the drafter a run trains: the backbone's fields and the variant's."""
    config = variant.drafter_config(drafter_config(cfg, target_config, layer_ids))
    if variant.init_std_from_target and getattr(target_config, "initializer_range", None) is not None:
        config.initializer_range = target_config.initializer_range
    if drafter_class_for(config).records_num_anchors:
        # DeepSpec's loader asserts it in config.json (dflash/export/deepspec.py).
        config.num_anchors = cfg.num_anchors
    return config


def build_drafter(
    cfg: DrafterConfig,
    target_config: Any,
    layer_ids: list[int],
    device: str,
    variant: DFlashVariant | None = None,
) -> DFlashDrafter:
    variant = variant or DFlashVariant()
    refusal = variant.device_refusal(torch.device(device))
    if refusal is not None:
        raise ValueError(refusal)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        drafter = variant.drafter(run_drafter_config(cfg, target_config, layer_ids, variant))
    return drafter.to(device)


def compile_drafter(drafter: DFlashDrafter, cfg: DrafterConfig, backend: Any = "inductor") -> None:
    """The drafter's training graph compiled as `drafter.compile_dynamic` / `drafter.compile_scope`
    say (dflash-train, the benchmarks and the checks alike)."""
    drafter.compile_training(backend, dynamic=cfg.compile_dynamic, scope=cfg.compile_scope.value)


def uses_flex_attention(cfg: DrafterConfig, device: torch.device) -> bool:
    """drafter.attention resolved: auto is flex on CUDA, the dense reference on CPU (whose
    flex_attention has no backward)."""
    kind = cfg.attention
    return kind is AttentionKind.flex or (kind is AttentionKind.auto and device.type == "cuda")


def uses_compile(setting: bool | None, device: torch.device) -> bool:
    """drafter.compile / target.compile resolved: null is on for CUDA; on CPU the compile time
    outweighs the gain for the tiny models that train there."""
    return setting if setting is not None else device.type == "cuda"


# Keys of the `optimizer` node that are the step's, not the optimizer class's arguments.
STEP_KEYS = ("grad_clip",)


def build_optimizer(node: OptimizerConfig, params) -> torch.optim.Optimizer:
    """The `optimizer` node's class over `params` (grad_clip is the step's, not an argument).
    It must be fused: DrafterStep.apply divides and clips the gradients through the fused
    kernel's `grad_scale` input and skips a non-finite step through `found_inf`; an unfused
    optimizer ignores both and would train on unnormalised, unclipped gradients."""
    optimizer = build(node, "optimizer", exclude=STEP_KEYS, params=params)
    if not optimizer.defaults.get("fused"):
        raise ValueError(
            f"optimizer: {node._target_} is not fused (optimizer.fused=true); the step scales and "
            "clips gradients through a fused optimizer's grad_scale input"
        )
    return optimizer


def build_lr_scheduler(node: LrScheduleConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    return build(node, "lr_schedule", optimizer=optimizer, total_steps=total_steps)


def build_noise(node: NoiseConfig) -> NoiseSchedule:
    return build(node, "noise")


def build_loss(node: LossConfig) -> BlockLoss:
    return build(node, "loss")


def block_settings_for(
    *,
    seed: int,
    drafter: DrafterConfig,
    loss: LossConfig,
    device: torch.device,
    variant: VariantConfig | None = None,
) -> BlockSettings:
    """How a run builds and scores its blocks on `device`: training's step and its validation,
    and tools that measure a checkpoint the way its run did (variant None: plain DFlash)."""
    return BlockSettings(
        seed=seed,
        num_anchors=drafter.num_anchors,
        loss=build_loss(loss),
        flex_attention=uses_flex_attention(drafter, device),
        compiled_loss=uses_compile(drafter.compile, device),
        variant=build_variant(variant),
    )


def build_step_fn(
    *,
    optimizer: OptimizerConfig,
    lr_schedule: LrScheduleConfig,
    noise: NoiseConfig,
    block_settings: BlockSettings,
    head: TargetHead,
    drafter: DFlashDrafter,
    total_steps: int,
    num_buckets: int,
) -> DrafterStep:
    built = build_optimizer(optimizer, drafter.parameters())
    return DrafterStep(
        head=head,
        drafter=drafter,
        optimizer=built,
        lr_scheduler=build_lr_scheduler(lr_schedule, built, total_steps),
        noise=build_noise(noise),
        block_settings=block_settings,
        grad_clip=optimizer.grad_clip,
        num_buckets=num_buckets,
    )
