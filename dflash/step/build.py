"""The drafter, its optimizer, LR schedule and step object, from config.

Shared by the run builder (dflash/run/launch.py) and the tools that build a step outside a run
(scripts/bench_step.py, scripts/check_fast_path.py, scripts/bench_decode.py).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from dflash.config.schema import (
    AttentionKind,
    Config,
    DrafterConfig,
    LrScheduleConfig,
    LrScheduleKind,
    OptimizerConfig,
)
from dflash.models.drafter import DFlashDrafter, drafter_config
from dflash.models.target_head import TargetHead
from dflash.step.noise import NoiseSchedule
from dflash.step.step import BlockSettings, DrafterStep


def build_drafter(cfg: DrafterConfig, target_config: Any, layer_ids: list[int], device: str) -> DFlashDrafter:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        drafter = DFlashDrafter(drafter_config(cfg, target_config, layer_ids))
    return drafter.to(device)


def uses_flex_attention(cfg: DrafterConfig, device: torch.device) -> bool:
    """drafter.attention resolved: auto is flex on CUDA, the dense reference on CPU (whose
    flex_attention has no backward)."""
    kind = cfg.attention
    return kind is AttentionKind.flex or (kind is AttentionKind.auto and device.type == "cuda")


def uses_compile(setting: bool | None, device: torch.device) -> bool:
    """drafter.compile resolved: null is on for CUDA; on CPU the compile time outweighs the
    gain for the tiny models that train there."""
    return setting if setting is not None else device.type == "cuda"


def build_optimizer(cfg: OptimizerConfig, params) -> torch.optim.Optimizer:
    # Fused (CPU and CUDA): one kernel for the whole update, and the `found_inf` input through
    # which a non-finite step is skipped on the device (DrafterStep.apply).
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        weight_decay=cfg.weight_decay,
        eps=cfg.eps,
        fused=True,
    )


def build_lr_scheduler(cfg: LrScheduleConfig, optimizer, total_steps: int):
    warmup = int(round(cfg.warmup_ratio * total_steps))
    if cfg.kind is LrScheduleKind.cosine:
        return get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    return get_constant_schedule_with_warmup(optimizer, warmup)


def block_settings_for(cfg: Config, drafter_device: torch.device) -> BlockSettings:
    """How a run builds and scores its blocks on `drafter_device`: training's step and its
    validation, and tools that measure a checkpoint the way its run did."""
    return BlockSettings(
        seed=cfg.seed,
        num_anchors=cfg.drafter.num_anchors,
        gamma=cfg.loss.gamma,
        logits_chunk=cfg.loss.logits_chunk,
        flex_attention=uses_flex_attention(cfg.drafter, drafter_device),
        compiled_loss=uses_compile(cfg.drafter.compile, drafter_device),
    )


def build_step_fn(
    cfg: Config, *, head: TargetHead, drafter: DFlashDrafter, total_steps: int, num_buckets: int
) -> DrafterStep:
    optimizer = build_optimizer(cfg.optimizer, drafter.parameters())
    return DrafterStep(
        head=head,
        drafter=drafter,
        optimizer=optimizer,
        lr_scheduler=build_lr_scheduler(cfg.lr_schedule, optimizer, total_steps),
        noise=NoiseSchedule.from_config(cfg.noise),
        block_settings=block_settings_for(cfg, next(drafter.parameters()).device),
        grad_clip=cfg.optimizer.grad_clip,
        num_buckets=num_buckets,
    )
