"""Turns a composed config into a runnable job. The only module that reads the whole `cfg`:
each component receives its own node (as a typed dataclass) plus runtime objects.

Order matters: every check that can fail on a bad config runs before any weights load.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from dflash.checkpoint import check_resume_matches, load_drafter_weights
from dflash.config.devices import ProcessSlot, resolve_device_split
from dflash.config.keys import refuse_unknown_keys
from dflash.config.nodes import node
from dflash.config.schema import (
    AttentionKind,
    Config,
    DataKind,
    DrafterConfig,
    LrScheduleConfig,
    LrScheduleKind,
    OptimizerConfig,
    PipelineKind,
    TargetConfig,
)
from dflash.config_checks import resolve_layer_ids, validate
from dflash.data.chat import ChatRenderer, load_chat_renderer
from dflash.data.dataset import TokenDataset
from dflash.data.prepare import PrepStats, load_or_prepare
from dflash.data.schedule import BatchPlanner, block_budget_for
from dflash.data.synthetic import load_or_generate
from dflash.distributed import (
    export_submitit_environment,
    init_from_env,
    require_same_layout,
    visible_cuda_devices,
)
from dflash.eval_prompts import PromptSet, load_prompt_sets
from dflash.models.compile import CompileCounter
from dflash.models.drafter import DFlashDrafter, drafter_config
from dflash.models.gguf import local_target
from dflash.models.target import FrozenTarget, load_target_config
from dflash.models.target_head import TargetHead, heads_for
from dflash.monitor.monitor import Monitor
from dflash.monitor.sinks import build_sinks
from dflash.noise import NoiseSchedule
from dflash.run import Run
from dflash.step import BlockSettings, DrafterStep
from dflash.trainer.async_trainer import AsyncTrainer, FaultInjection
from dflash.trainer.periodic_eval import PeriodicEval
from dflash.trainer.state import CheckpointSettings
from dflash.trainer.sync import SyncTrainer
from dflash.trainer.validation import Validation, held_out_ids

log = logging.getLogger(__name__)


def target_node(cfg: DictConfig) -> TargetConfig:
    """`target`, typed, with a GGUF path (a file or `package:<name>`) replaced by its converted
    transformers directory under paths.cache_dir (converted the first time)."""
    return local_target(node(cfg, "target"), cfg.paths.cache_dir)


def build_drafter(cfg: DrafterConfig, target_config: Any, layer_ids: list[int], device: str) -> DFlashDrafter:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        drafter = DFlashDrafter(drafter_config(cfg, target_config, layer_ids))
    return drafter.to(device)


def uses_flex_attention(cfg: DrafterConfig, device: torch.device) -> bool:
    """drafter.attention resolved: auto is flex on CUDA, the dense reference on CPU (whose
    flex_attention has no backward)."""
    kind = AttentionKind(cfg.attention)
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
    if LrScheduleKind(cfg.kind) is LrScheduleKind.cosine:
        return get_cosine_schedule_with_warmup(optimizer, warmup, total_steps)
    return get_constant_schedule_with_warmup(optimizer, warmup)


def total_steps_for(cfg: DictConfig, planner: BatchPlanner, num_replicas: int) -> int:
    """Optimizer steps; with several drafter replicas each step consumes one batch per replica."""
    if cfg.train.total_steps is not None:
        return cfg.train.total_steps
    batches = sum(planner.batches_per_epoch(epoch) for epoch in range(cfg.train.epochs))
    return max(1, batches // num_replicas)


def build_step_fn(
    cfg: DictConfig, *, head: TargetHead, drafter: DFlashDrafter, total_steps: int, num_buckets: int
) -> DrafterStep:
    optimizer = build_optimizer(node(cfg, "optimizer"), drafter.parameters())
    drafter_device = next(drafter.parameters()).device
    return DrafterStep(
        head,
        drafter,
        optimizer,
        build_lr_scheduler(node(cfg, "lr_schedule"), optimizer, total_steps),
        NoiseSchedule.from_config(node(cfg, "noise")),
        BlockSettings(
            seed=cfg.seed,
            num_anchors=cfg.drafter.num_anchors,
            gamma=cfg.loss.gamma,
            logits_chunk=cfg.loss.logits_chunk,
            flex_attention=uses_flex_attention(node(cfg, "drafter"), drafter_device),
            compiled_loss=uses_compile(cfg.drafter.compile, drafter_device),
        ),
        grad_clip=cfg.optimizer.grad_clip,
        num_buckets=num_buckets,
    )


def load_training_data(
    cfg: DictConfig, target: FrozenTarget | None = None
) -> tuple[TokenDataset, PrepStats | None]:
    """The samples `cfg.data` describes, from the cache when it holds them.

    synthetic: written by `target` the first time (a CPU copy when None: tools that only need
    the data); the drafter's mask id never appears in a generated prompt. conversations:
    rendered and tokenized from `data.files` (no model needed).
    """
    data_cfg, target_cfg = node(cfg, "data"), target_node(cfg)
    if DataKind(data_cfg.kind) is DataKind.synthetic:
        if target is None:
            layer_ids = resolve_layer_ids(cfg, load_target_config(target_cfg).num_hidden_layers)
            target = FrozenTarget.from_config(target_cfg, layer_ids, torch.device("cpu"))
        dataset = load_or_generate(
            target, target_cfg, data_cfg, Path(cfg.paths.cache_dir), [cfg.drafter.mask_token_id]
        )
        return dataset, None
    renderer = load_chat_renderer(target_cfg, "data.kind=conversations")
    dataset, stats = load_or_prepare(renderer, data_cfg, Path(cfg.paths.cache_dir))
    # Text data: the mask id must be a token the tokenizer never produces (a reserved special).
    holding_mask = int((dataset.input_ids == cfg.drafter.mask_token_id).sum())
    if holding_mask:
        raise ValueError(
            f"drafter.mask_token_id={cfg.drafter.mask_token_id} occurs {holding_mask} times in the "
            f"training data (data.files={list(data_cfg.files)}); pick an id the tokenizer never produces"
        )
    return dataset, stats


def eval_prompt_sets(
    cfg: DictConfig, target_cfg: TargetConfig, vocab_size: int, mask_token_id: int, limit: int
) -> list[PromptSet]:
    """The held-out prompts: `eval.benchmarks` files (the target's chat template), else random
    token prompts (never holding the drafter's mask id)."""
    eval_cfg = node(cfg, "eval")
    for key in ("num_prompts", "periodic_num_prompts", "max_new_tokens"):
        if getattr(eval_cfg, key) < 1:
            raise ValueError(f"eval.{key} must be >= 1, got {getattr(eval_cfg, key)}")

    def renderer() -> ChatRenderer:
        return load_chat_renderer(target_cfg, "eval.benchmarks")

    if not eval_cfg.benchmarks and DataKind(cfg.data.kind) is DataKind.conversations:
        log.warning(
            "eval.benchmarks is empty: tau is measured on random token prompts, unlike the "
            "conversations in data.files; set 'eval.benchmarks={name: prompts.jsonl}'"
        )

    return load_prompt_sets(eval_cfg, renderer, vocab_size, [mask_token_id], limit)


def build_run(cfg: DictConfig, faults: FaultInjection | None = None) -> Run:
    # 1. Everything checkable without weights.
    refuse_unknown_keys(cfg, Config)
    target_cfg: TargetConfig = target_node(cfg)
    drafter_cfg: DrafterConfig = node(cfg, "drafter")
    target_config = load_target_config(target_cfg)
    export_submitit_environment()
    slot = ProcessSlot.from_env()
    validate(
        cfg,
        num_target_layers=target_config.num_hidden_layers,
        target_vocab_size=target_config.vocab_size,
        visible_cuda_devices=visible_cuda_devices(),
        slot=slot,
    )
    layer_ids = resolve_layer_ids(cfg, target_config.num_hidden_layers)
    target_devices, drafter_devices = resolve_device_split(cfg, visible_cuda_devices(), slot)
    if "cpu" in target_devices + drafter_devices:
        torch.set_num_threads(cfg.gpu.cpu_threads)
    mask_id, vocab_size = cfg.drafter.mask_token_id, target_config.vocab_size
    eval_prompts = eval_prompt_sets(cfg, target_cfg, vocab_size, mask_id, cfg.eval.num_prompts)
    periodic_prompts = None
    if cfg.eval.every_steps > 0:
        periodic_prompts = eval_prompt_sets(
            cfg, target_cfg, vocab_size, mask_id, cfg.eval.periodic_num_prompts
        )
    resume_dir = Path(cfg.resume) if cfg.resume else None
    if resume_dir is not None:
        if not resume_dir.is_dir():
            raise ValueError(f"resume={cfg.resume}: no such checkpoint directory")
        run_target = OmegaConf.to_container(cfg.target, resolve=True, enum_to_str=True)
        check_resume_matches(resume_dir, drafter_config(drafter_cfg, target_config, layer_ids), run_target)
    process_group = init_from_env(drafter_devices[0])
    require_same_layout(process_group, target_devices, drafter_devices)
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run_config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    (run_dir / "config_resolved.yaml").write_text(run_config_yaml)
    torch.manual_seed(cfg.seed)

    # 2. Models and data: one frozen target per target device, one drafter replica per drafter
    # device (identical init, so replicas start, and stay, identical).
    targets = [FrozenTarget.from_config(target_cfg, layer_ids, torch.device(d)) for d in target_devices]
    compiled: dict[str, CompileCounter] = {}  # graphs torch.compile built, per role (summary.json)
    if target_cfg.compile:
        compiled["target"] = CompileCounter("target features")
        for target in targets:
            target.compile_features(compiled["target"])
    drafters = [build_drafter(drafter_cfg, target_config, layer_ids, d) for d in drafter_devices]
    if resume_dir is not None:
        for drafter in drafters:
            try:
                load_drafter_weights(drafter, resume_dir)
            except ValueError as exc:
                raise ValueError(f"resume={resume_dir}: {exc}") from exc
    if uses_compile(drafter_cfg.compile, torch.device(drafter_devices[0])):
        compiled["drafter"] = CompileCounter("drafter")
        for drafter in drafters:
            drafter.compile_training(compiled["drafter"])
    dataset, prep_stats = load_training_data(cfg, targets[0])
    if prep_stats is not None:
        log.info("data: %s", "; ".join(line.strip() for line in prep_stats.lines()))
    sched = node(cfg, "scheduler")
    budget = block_budget_for(sched, num_anchors=drafter_cfg.num_anchors, block_size=drafter_cfg.block_size)
    val_ids = held_out_ids(len(dataset), cfg.data.val_samples, cfg.seed) if cfg.data.val_samples else None
    planner = BatchPlanner(dataset.lengths, sched, cfg.seed, budget, held_out=val_ids)
    total_steps = total_steps_for(cfg, planner, len(drafters) * process_group.world_size)

    # 3. Optimization and the loop. Each replica embeds and scores its blocks with the target's
    # tables on its own device (a frozen copy where no target lives).
    step_fns = [
        build_step_fn(
            cfg, head=head, drafter=drafter, total_steps=total_steps, num_buckets=planner.num_buckets
        )
        for head, drafter in zip(heads_for(drafter_devices, targets), drafters)
    ]
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    # Multi-node: rank 0 alone logs (and checkpoints; see AsyncTrainer.save).
    stop_after = min(total_steps, cfg.debug.max_steps or total_steps)
    checkpoints = CheckpointSettings(
        run_dir / "checkpoints", cfg.checkpoint.every_steps, cfg.checkpoint.keep_last, run_config_yaml
    )
    if PipelineKind(cfg.pipeline.kind) is PipelineKind.sync:
        trainer = SyncTrainer(
            target=targets[0],
            step_fn=step_fns[0],
            dataset=dataset,
            planner=planner,
            stop_after=stop_after,
            log_every=cfg.logger.every_steps,
            checkpoints=checkpoints,
        )
    else:
        trainer = AsyncTrainer(
            targets=targets,
            step_fns=step_fns,
            dataset=dataset,
            planner=planner,
            stop_after=stop_after,
            log_every=cfg.logger.every_steps,
            checkpoints=checkpoints,
            cfg=node(cfg, "pipeline"),
            max_length=cfg.data.max_length,
            faults=faults,
            process_group=process_group,
        )
    if resume_dir is not None:
        trainer.restore(resume_dir)
    # After the restore: a resumed run's progress bar starts where the run left off.
    sinks = (
        build_sinks(node(cfg, "logger"), run_dir, resolved, stop_after, start_step=trainer.position.step)
        if process_group.is_main
        else []
    )
    trainer.monitor = Monitor(node(cfg, "monitor"), sinks, trainer, stop_after)
    validation = None
    if val_ids is not None and process_group.is_main:
        validation = Validation(
            dataset,
            val_ids,
            settings=step_fns[0].block_settings,
            tokens_per_batch=sched.tokens_per_batch,
            block_budget=budget,
        )
    if periodic_prompts is not None and process_group.is_main:
        trainer.periodic_eval = PeriodicEval(
            node(cfg, "eval"), targets[0], drafters[0], periodic_prompts, validation=validation
        )
        trainer.periodic_eval.monitor = trainer.monitor
    log.info(
        "dflash: %d samples, %d steps (%d batches in epoch 0), target layers %s, devices %s -> %s, pipeline=%s",
        len(dataset),
        total_steps,
        planner.batches_per_epoch(0),
        layer_ids,
        target_devices,
        drafter_devices,
        cfg.pipeline.kind.value,
    )
    return Run(cfg, run_dir, trainer, total_steps, process_group, eval_prompts, compiled, validation)
