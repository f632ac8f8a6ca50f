"""Phase 1 of building a run: everything that can be checked or settled without loading weights.

Unknown keys, the cross-field rules, layer ids and the device split, the prompt sets, a `resume=`
checkpoint that must fit this drafter and target, the process group; then the run directory and
its config_resolved.yaml. A bad config fails here, in one line, before any model loads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dflash.config.components import check_buildable
from dflash.config.devices import ProcessSlot, resolve_device_split
from dflash.config.keys import refuse_unknown_keys
from dflash.config.schema import Config, DataKind, TargetConfig
from dflash.config.typed import expand_home, typed_config
from dflash.data.chat import load_chat_renderer
from dflash.distributed import (
    ProcessGroupInfo,
    export_submitit_environment,
    init_from_env,
    require_same_layout,
    visible_cuda_devices,
)
from dflash.eval.prompt_sets import PromptSet
from dflash.monitor.sinks import (
    MLFLOW_RUN_FILE,
    SINK_LIBRARIES,
    MlflowSink,
    check_sink_destinations,
    mlflow_sink,
    resumed_mlflow_run,
)
from dflash.run.checks import resolve_layer_ids, validate
from dflash.run.inputs import eval_prompt_sets, local_target_config
from dflash.run.ownership import refuse_earlier_run, set_aside_untrained_attempt
from dflash.run.resume import check_resume_matches
from dflash.step.build import STEP_KEYS, build_variant, run_drafter_config
from dflash.target.model import load_target_config
from dflash.target.target_identity import target_identity
from dflash.trainer.lifecycle import TRAINER_INPUTS

log = logging.getLogger(__name__)


@dataclass
class Checked:
    """What phase 1 settles before any weights load: the typed nodes the builders need, the
    resolved layer ids and device split, the run directory and the process group."""

    config: Config  # the composed config, typed (converted once, here)
    resolved: dict[str, Any]  # the same as plain data (sinks, summary)
    target_cfg: TargetConfig  # config.target with a GGUF path replaced by its converted directory
    target_config: Any  # the target's transformers config
    layer_ids: list[int]
    target_devices: list[str]
    drafter_devices: list[str]
    eval_prompts: list[PromptSet]
    periodic_prompts: list[PromptSet] | None  # eval.every_steps > 0
    resume_dir: Path | None
    init_dir: Path | None  # drafter.init_from, on a fresh start
    process_group: ProcessGroupInfo
    run_dir: Path
    run_config_yaml: str
    target_identity: dict  # dflash/target/target_identity.py


# The runtime keyword arguments the launcher builds each component with (dflash/run/launch.py),
# besides its node's own keys: a `_target_` whose signature cannot take them is refused here.
COMPONENT_RUNTIME: dict[str, tuple[str, ...]] = {
    "scheduler": (
        "lengths",
        "bucket_edges",
        "tokens_per_batch",
        "block_tokens_per_batch",
        "seed",
        "num_anchors",
        "block_size",
        "held_out",
    ),
    "optimizer": ("params",),
    "lr_schedule": ("optimizer", "total_steps"),
    "loss": (),
    "variant": (),
    "noise": (),
    "pipeline": (TRAINER_INPUTS,),
    "monitor": ("sinks", "probe", "total_steps"),
}


def check_components(cfg: Config) -> None:
    """Every component's `_target_` imports and takes its node's keys plus its runtime arguments
    (a user's class too), before any weights load; the metric sinks likewise."""
    for key, runtime in COMPONENT_RUNTIME.items():
        exclude = STEP_KEYS if key == "optimizer" else ()
        check_buildable(getattr(cfg, key), key, runtime=runtime, exclude=exclude)
    for name, node in cfg.logger.sinks.items():
        built_by = check_buildable(node, f"logger.sinks.{name}", runtime=("context",))
        library = SINK_LIBRARIES.get(built_by)
        if library is not None:  # an optional extra the sink needs is installed
            library.check(f"logger.sinks.{name}")


def check_resumed_stores(cfg: Config, resume_dir: Path | None) -> None:
    """A resumed run's MLflow sink continues the run its checkpoint names: a local store that is no
    longer there is refused now, before any weights load, not when the sink opens it."""
    for name, node in cfg.logger.sinks.items():
        if check_buildable(node, f"logger.sinks.{name}", runtime=("context",)) not in (
            MlflowSink,
            mlflow_sink,
        ):
            continue
        resumed = resumed_mlflow_run(resume_dir)
        if resumed is None:
            continue
        uri = getattr(node, "tracking_uri", None) or resumed["tracking_uri"]
        database = uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else None
        if database is not None and not Path(database).is_file():
            raise ValueError(
                f"resume={resume_dir}: {MLFLOW_RUN_FILE} names MLflow run {resumed['run_id']} in {uri}, "
                f"which does not exist; set logger.sinks.{name}.tracking_uri to the store that holds it"
            )


def prompt_sets(cfg: Config, target_cfg: TargetConfig, target_config):
    """The final evaluation's prompt sets and, with eval.every_steps > 0, the periodic one's."""
    mask_id, vocab_size = cfg.drafter.mask_token_id, target_config.vocab_size
    context = getattr(target_config, "max_position_embeddings", None)
    final = eval_prompt_sets(cfg, target_cfg, vocab_size, mask_id, cfg.eval.num_prompts, context)
    if cfg.eval.every_steps <= 0:
        return final, None
    return final, eval_prompt_sets(
        cfg, target_cfg, vocab_size, mask_id, cfg.eval.periodic_num_prompts, context
    )


def checked_drafter_dir(
    path: str | None, run_drafter_config, run_target: dict, key: str, run_identity: dict | None = None
) -> Path | None:
    """`resume=` or `drafter.init_from=` (`key`): a drafter directory of this drafter and target
    (by content: `run_identity`), refused before any load."""
    if not path:
        return None
    directory = Path(path)
    if not directory.is_dir():
        kind = "checkpoint" if key == "resume" else "drafter"
        raise ValueError(f"{key}={path}: no such {kind} directory")
    check_resume_matches(directory, run_drafter_config, run_target, key=key, run_identity=run_identity)
    return directory


def check_before_loading(composed: DictConfig) -> Checked:
    """Phase 1: everything checkable without weights; writes config_resolved.yaml. The composed
    config is converted to its typed form here, once; every later phase reads `Checked.config`."""
    refuse_unknown_keys(composed, Config)
    expand_home(composed)
    resolved = OmegaConf.to_container(composed, resolve=True, enum_to_str=True)
    run_config_yaml = OmegaConf.to_yaml(composed, resolve=True)
    cfg = typed_config(composed)
    target_cfg = local_target_config(cfg)
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
    check_components(cfg)
    layer_ids = resolve_layer_ids(cfg, target_config.num_hidden_layers)
    target_devices, drafter_devices = resolve_device_split(cfg, visible_cuda_devices(), slot)
    if "cpu" in target_devices + drafter_devices:
        torch.set_num_threads(cfg.gpu.cpu_threads)
    eval_prompts, periodic_prompts = prompt_sets(cfg, target_cfg, target_config)
    if cfg.data.kind is DataKind.conversations:  # the chat template parses (the file named)
        load_chat_renderer(target_cfg, "data.kind=conversations")
    run_drafter = run_drafter_config(cfg.drafter, target_config, layer_ids, build_variant(cfg.variant))
    identity = target_identity(target_cfg)
    resume_dir = checked_drafter_dir(cfg.resume, run_drafter, resolved["target"], "resume", identity)
    check_resumed_stores(cfg, resume_dir)
    check_sink_destinations(cfg.logger.sinks, run_dir=Path(cfg.paths.output_dir), resume_dir=resume_dir)
    init_dir = None
    if resume_dir is None:  # a resumed run continues from its checkpoint's weights
        init_dir = checked_drafter_dir(
            cfg.drafter.init_from, run_drafter, resolved["target"], "drafter.init_from", identity
        )
    process_group = init_from_env(drafter_devices[0])
    require_same_layout(process_group, target_devices, drafter_devices)
    run_dir = Path(cfg.paths.output_dir)
    refuse_earlier_run(run_dir, resume=cfg.resume)
    if cfg.resume is None and (moved := set_aside_untrained_attempt(run_dir)) is not None:
        log.warning(
            "%s: an earlier attempt here stopped before its first step; its rows moved to %s", run_dir, moved
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config_resolved.yaml").write_text(run_config_yaml)
    return Checked(
        config=cfg,
        resolved=resolved,
        target_cfg=target_cfg,
        target_config=target_config,
        layer_ids=layer_ids,
        target_devices=target_devices,
        drafter_devices=drafter_devices,
        eval_prompts=eval_prompts,
        periodic_prompts=periodic_prompts,
        resume_dir=resume_dir,
        init_dir=init_dir,
        process_group=process_group,
        run_dir=run_dir,
        run_config_yaml=run_config_yaml,
        target_identity=identity,
    )
