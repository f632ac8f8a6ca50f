"""The launcher: a composed config -> checks -> components -> a runnable job.

`build_run` reads top to bottom: `check_before_loading` (every refusal a bad config can earn,
before any weights load; the callbacks and every component's `_target_` are resolved there),
the models, the schedule (`scheduler`), the step objects (`optimizer`, `lr_schedule`, `noise`,
`loss`), the trainer (`pipeline`), the observers (`logger.sinks`, `monitor`, `callbacks`). Each
component is built with hydra.utils.instantiate from its own config node plus runtime objects
(dflash/config/components.py); this module is the one place that reads the whole config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from omegaconf import DictConfig

from dflash import __version__
from dflash.config.components import build
from dflash.config.schema import Config, pipeline_name
from dflash.data.dataset import TokenDataset
from dflash.data.scheduler import BatchPlanner, build_planner, held_out_ids
from dflash.drafters.backbone import DFlashDrafter
from dflash.export.card import TrainingFacts
from dflash.export.zlab import load_drafter_weights, read_drafter_config
from dflash.monitor.callbacks import TrainingCallbacks, build_callbacks
from dflash.monitor.sinks import SinkContext, build_sinks
from dflash.run.inputs import load_training_data, training_data_identity
from dflash.run.preflight import Checked, check_before_loading
from dflash.run.resume import check_resume_data, refuse_resume_past_end, warm_starts_new_parts
from dflash.run.runner import Run
from dflash.step.build import (
    block_settings_for,
    build_drafter,
    build_step_fn,
    build_variant,
    compile_drafter,
    uses_compile,
)
from dflash.step.step import BlockSettings, DrafterStep
from dflash.target.feature_check import check_target_features
from dflash.target.model import FrozenTarget
from dflash.target.target_head import TargetHead, heads_for
from dflash.torch_runtime.compile import CompileCounter
from dflash.trainer.async_trainer import FaultInjection
from dflash.trainer.lifecycle import TRAINER_INPUTS, Trainer, TrainerInputs
from dflash.trainer.periodic_eval import PeriodicEval
from dflash.trainer.state import CheckpointSettings
from dflash.trainer.validation import Validation

log = logging.getLogger(__name__)


def total_steps_for(cfg: Config, planner: BatchPlanner, num_replicas: int) -> int:
    """Optimizer steps; with several drafter replicas each step consumes one batch per replica."""
    if cfg.train.total_steps is not None:
        return cfg.train.total_steps
    batches = sum(planner.batches_per_epoch(epoch) for epoch in range(cfg.train.epochs))
    return max(1, batches // num_replicas)


@dataclass
class Models:
    targets: list[FrozenTarget]
    drafters: list[DFlashDrafter]
    compiled: dict[str, CompileCounter]  # graphs torch.compile built, per role (summary.json)


@dataclass
class Schedule:
    dataset: TokenDataset
    planner: BatchPlanner
    val_ids: np.ndarray | None  # data.val_samples: held out, never planned
    total_steps: int
    data_identity: dict  # what the samples are (dflash/data/identity.py): data.json


def build_models(checked: Checked) -> Models:
    """One frozen target per target device, one drafter replica per drafter device (identical
    init, so replicas start, and stay, identical); resumed or drafter.init_from weights; compiled
    graphs."""
    variant = build_variant(checked.config.variant)
    targets = [
        FrozenTarget.from_config(
            checked.target_cfg, checked.layer_ids, torch.device(d), final_state=variant.needs_final_state
        )
        for d in checked.target_devices
    ]
    compiled: dict[str, CompileCounter] = {}
    if uses_compile(checked.target_cfg.compile, torch.device(checked.target_devices[0])):
        compiled["target"] = CompileCounter("target features")
        for target in targets:
            target.compile_features(
                compiled["target"],
                dynamic=checked.target_cfg.compile_dynamic,
                scope=checked.target_cfg.compile_scope.value,
            )
    if checked.target_cfg.cuda_graphs:
        for target in targets:
            target.use_feature_graphs(checked.target_cfg.cuda_graphs)
    drafters = [
        build_drafter(checked.config.drafter, checked.target_config, checked.layer_ids, d, variant)
        for d in checked.drafter_devices
    ]
    for key, directory in (("resume", checked.resume_dir), ("drafter.init_from", checked.init_dir)):
        if directory is None:
            continue
        log.info("drafter weights from %s=%s", key, directory)
        new_parts = warm_starts_new_parts(read_drafter_config(directory), drafters[0].config, key)
        for drafter in drafters:
            try:
                load_drafter_weights(drafter, directory, new_parts=new_parts)
            except ValueError as exc:
                raise ValueError(f"{key}={directory}: {exc}") from exc
    if uses_compile(checked.config.drafter.compile, torch.device(checked.drafter_devices[0])):
        compiled["drafter"] = CompileCounter("drafter")
        for drafter in drafters:
            compile_drafter(drafter, checked.config.drafter, compiled["drafter"])
    return Models(targets, drafters, compiled)


def plan_batches(cfg: Config, dataset: TokenDataset) -> tuple[BatchPlanner, np.ndarray | None]:
    """The `scheduler` node's planner of every epoch's batches (packed under the drafter's block
    budget) and the held-out sample ids it never plans (data.val_samples; None without a split).
    Tools that replay a run's batches (scripts/check_fast_path.py) take them from here."""
    val_ids = held_out_ids(len(dataset), cfg.data.val_samples, cfg.seed) if cfg.data.val_samples else None
    planner = build_planner(
        cfg.scheduler,
        data=cfg.data,
        lengths=dataset.lengths,
        seed=cfg.seed,
        num_anchors=cfg.drafter.num_anchors,
        block_size=cfg.drafter.block_size,
        held_out=val_ids,
    )
    return planner, val_ids


def block_settings_of(cfg: Config, device: torch.device) -> BlockSettings:
    """How the run builds and scores blocks on a drafter device (seed, anchors, the `loss` node,
    the drafter's kernels): its step, its validation, tools that measure its checkpoints."""
    return block_settings_for(
        seed=cfg.seed, drafter=cfg.drafter, loss=cfg.loss, device=device, variant=cfg.variant
    )


def step_fn_for(
    cfg: Config, *, head: TargetHead, drafter: DFlashDrafter, total_steps: int, num_buckets: int
) -> DrafterStep:
    """One replica's step object from the `optimizer`, `lr_schedule` and `noise` nodes."""
    return build_step_fn(
        optimizer=cfg.optimizer,
        lr_schedule=cfg.lr_schedule,
        noise=cfg.noise,
        block_settings=block_settings_of(cfg, next(drafter.parameters()).device),
        head=head,
        drafter=drafter,
        total_steps=total_steps,
        num_buckets=num_buckets,
    )


def build_schedule(checked: Checked, models: Models) -> Schedule:
    """The training samples, the held-out split and every epoch's batch plan."""
    cfg = checked.config
    dataset, prep_stats = load_training_data(cfg, models.targets[0])
    if prep_stats is not None:
        log.info("data: %s", "; ".join(line.strip() for line in prep_stats.lines()))
    planner, val_ids = plan_batches(cfg, dataset)
    replicas = len(models.drafters) * checked.process_group.world_size
    identity = training_data_identity(cfg, dataset)
    if checked.resume_dir is not None:
        check_resume_data(checked.resume_dir, identity, dataset, accept_changes=cfg.resume_changed_data)
    return Schedule(dataset, planner, val_ids, total_steps_for(cfg, planner, replicas), identity)


def check_features(checked: Checked, models: Models, dataset: TokenDataset) -> None:
    """Every target's captured features on the first training sample, before any step
    (dflash/target/feature_check.py); rank 0 writes the figures into the run dir."""
    source = (
        f"target.path={checked.target_cfg.path}"
        if checked.target_cfg.path
        else f"target={checked.target_cfg.name}"
    )
    input_ids, _ = dataset[0]
    for target in models.targets:
        check_target_features(
            features_of=target.reference_features,
            input_ids=input_ids.to(target.device),
            layer_ids=checked.layer_ids,
            run_dir=checked.run_dir if checked.process_group.is_main else None,
            source=f"{source} on {target.device}",
        )


def build_step_fns(*, checked: Checked, models: Models, schedule: Schedule) -> list[DrafterStep]:
    """One step object per drafter replica; each embeds and scores its blocks with the target's
    tables on its own device (a frozen copy where no target lives)."""
    return [
        step_fn_for(
            checked.config,
            head=head,
            drafter=drafter,
            total_steps=schedule.total_steps,
            num_buckets=schedule.planner.num_buckets,
        )
        for head, drafter in zip(heads_for(checked.drafter_devices, models.targets), models.drafters)
    ]


def training_facts(checked: Checked, schedule: Schedule) -> TrainingFacts:
    """What the model card of each checkpoint says about this run (steps: each checkpoint's)."""
    cfg = checked.config
    held_out = 0 if schedule.val_ids is None else len(schedule.val_ids)
    files = ", ".join(cfg.data.files)
    return TrainingFacts(
        target=cfg.target.path or f"{cfg.target.name} (random-init)",
        target_path=cfg.target.path,
        target_model_type=getattr(checked.target_config, "model_type", None),
        data=f"data={cfg.data.name}" + (f": {files}" if files else ""),
        samples=len(schedule.dataset) - held_out,
        steps=0,
        seed=cfg.seed,
        dflash_version=__version__,
    )


def build_trainer(
    *,
    checked: Checked,
    models: Models,
    schedule: Schedule,
    step_fns: list[DrafterStep],
    faults: FaultInjection | None,
) -> Trainer:
    cfg = checked.config
    stop_after = min(schedule.total_steps, cfg.debug.max_steps or schedule.total_steps)
    checkpoints = CheckpointSettings(
        directory=checked.run_dir / "checkpoints",
        every_steps=cfg.checkpoint.every_steps,
        keep_last=cfg.checkpoint.keep_last,
        run_config_yaml=checked.run_config_yaml,
        target_identity=checked.target_identity,
        data_identity=schedule.data_identity,
        card=training_facts(checked, schedule),
    )
    inputs = TrainerInputs(
        targets=models.targets,
        step_fns=step_fns,
        dataset=schedule.dataset,
        planner=schedule.planner,
        stop_after=stop_after,
        log_every=cfg.logger.every_steps,
        checkpoints=checkpoints,
        process_group=checked.process_group,
    )
    runtime: dict = {TRAINER_INPUTS: inputs}
    if faults is not None:  # tests: a target worker or drafter that raises on cue
        runtime["faults"] = faults
    return build(cfg.pipeline, "pipeline", **runtime)


def attach_observers(
    trainer: Trainer,
    *,
    checked: Checked,
    models: Models,
    schedule: Schedule,
    block_settings: BlockSettings,
    callbacks: TrainingCallbacks,
) -> Validation | None:
    """Rank 0's sinks and monitor (every rank has a monitor; the others log nowhere), the
    held-out validation and the periodic evaluation; the callbacks get every logged row as a
    sink does, and the trainer's checkpoints."""
    cfg, is_main = checked.config, checked.process_group.is_main
    # After the restore: a resumed run's progress bar starts where the run left off.
    context = SinkContext(
        run_dir=checked.run_dir,
        config=checked.resolved,
        total_steps=trainer.stop_after,
        start_step=trainer.position.step,
        resume_dir=checked.resume_dir,
    )
    sinks = build_sinks(cfg.logger.sinks, context) if is_main else []
    # Sinks with a checkpoint hook (W&B: the run id, artifacts) hear of each checkpoint.
    callbacks = TrainingCallbacks(
        {
            **callbacks.callbacks,
            **{
                f"logger.sinks.{i}": s
                for i, s in enumerate(sinks)
                if callable(getattr(s, "on_checkpoint", None))
            },
        }
    )
    if callbacks:
        sinks.append(callbacks)
    monitor = build(cfg.monitor, "monitor", sinks=sinks, probe=trainer, total_steps=trainer.stop_after)
    validation = None
    if schedule.val_ids is not None and is_main:
        validation = Validation(
            schedule.dataset,
            schedule.val_ids,
            settings=block_settings,
            tokens_per_batch=cfg.data.tokens_per_batch,
            block_budget=schedule.planner.block_budget,
        )
    periodic_eval = None
    if checked.periodic_prompts is not None and is_main:
        periodic_eval = PeriodicEval(
            cfg=cfg.eval,
            target=models.targets[0],
            drafter=models.drafters[0],
            prompt_sets=checked.periodic_prompts,
            monitor=monitor,
            validation=validation,
        )
    trainer.attach(monitor=monitor, periodic_eval=periodic_eval, callbacks=callbacks)
    return validation


def build_run(composed: DictConfig, faults: FaultInjection | None = None) -> Run:
    checked = check_before_loading(composed)
    cfg = checked.config
    # Before any weights load: a callback that cannot be built is refused at once (rank 0 only
    # reports, so only it runs them).
    callbacks = build_callbacks(cfg.callbacks) if checked.process_group.is_main else TrainingCallbacks()
    torch.manual_seed(cfg.seed)
    models = build_models(checked)
    schedule = build_schedule(checked, models)
    check_features(checked, models, schedule.dataset)
    step_fns = build_step_fns(checked=checked, models=models, schedule=schedule)
    trainer = build_trainer(
        checked=checked, models=models, schedule=schedule, step_fns=step_fns, faults=faults
    )
    if checked.resume_dir is not None:
        trainer.restore(checked.resume_dir)
        refuse_resume_past_end(checked.resume_dir, trainer.position.step, trainer.stop_after)
    for counter in models.compiled.values():  # later graphs are compiled mid-run: warned about
        trainer.at_first_step(counter.settle)
    validation = attach_observers(
        trainer,
        checked=checked,
        models=models,
        schedule=schedule,
        block_settings=step_fns[0].block_settings,
        callbacks=callbacks,
    )
    log.info(
        "dflash: %d samples, %d steps (%d batches in epoch 0), target layers %s, devices %s -> %s, pipeline=%s",
        len(schedule.dataset),
        schedule.total_steps,
        schedule.planner.batches_per_epoch(0),
        checked.layer_ids,
        checked.target_devices,
        checked.drafter_devices,
        pipeline_name(cfg.pipeline),
    )
    return Run(
        cfg=cfg,
        run_dir=checked.run_dir,
        trainer=trainer,
        total_steps=schedule.total_steps,
        process_group=checked.process_group,
        eval_prompts=checked.eval_prompts,
        compiled=models.compiled,
        validation=validation,
        callbacks=callbacks,
    )
