"""What a checkpoint records about training progress, shared by the sync and async trainers."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash.export.card import TrainingFacts
from dflash.step.step import DrafterStep
from dflash.trainer.checkpoint import load_trainer_state, save_checkpoint

log = logging.getLogger(__name__)


@dataclass
class DataPosition:
    """Progress through the batch schedule (a single sequence across epochs).

    Every batch before `next_seq` has been trained on, and so have those in `done_beyond`
    (with several target workers, batches can finish out of order); the rest are fed again
    after a resume.
    """

    next_seq: int = 0
    step: int = 0
    done_beyond: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"next_seq": self.next_seq, "step": self.step, "done_beyond": sorted(self.done_beyond)}


@dataclass(kw_only=True)
class CheckpointSettings:
    directory: Path
    every_steps: int
    keep_last: int
    run_config_yaml: str
    target_identity: dict[str, Any] | None = None  # dflash/target/target_identity.py: kept as target.json
    data_identity: dict[str, Any] | None = None  # dflash/data/identity.py: kept as data.json
    card: TrainingFacts | None = None  # the model card's facts; its steps are each checkpoint's own


def trainer_state(step_fn: DrafterStep, position: DataPosition) -> dict[str, Any]:
    state = {
        "optimizer": step_fn.optimizer.state_dict(),
        "lr_scheduler": step_fn.lr_scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state()},
        "position": position.as_dict(),
    }
    if torch.cuda.is_available():
        state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(settings: CheckpointSettings, step_fn: DrafterStep, position: DataPosition) -> Path:
    path = save_checkpoint(
        settings.directory,
        position.step,
        step_fn.drafter,
        trainer_state(step_fn, position),
        settings.run_config_yaml,
        settings.keep_last,
        target_identity=settings.target_identity,
        data_identity=settings.data_identity,
        card=dataclasses.replace(settings.card, steps=position.step) if settings.card is not None else None,
    )
    log.info("checkpoint: %s", path)
    return path


def restore(directory: Path, step_fns: list[DrafterStep]) -> DataPosition:
    """Optimizer, LR schedule and RNG into every replica; returns where the data continues.

    The drafter weights themselves are loaded by the builder, before the replicas are made.
    """
    state = load_trainer_state(directory)
    for step_fn in step_fns:
        step_fn.optimizer.load_state_dict(state["optimizer"])
        step_fn.lr_scheduler.load_state_dict(state["lr_scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    position = DataPosition(**state["position"])
    log.info("resumed from %s at %s", directory, position)
    return position
