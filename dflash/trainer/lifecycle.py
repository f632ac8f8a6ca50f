"""The one training lifecycle both pipelines share: restore, run, stop, checkpoint.

`Trainer.run` is written once: it installs the signal handlers, lets the pipeline train
(`_train`), and then closes the run the same way whichever pipeline ran it: the last metric
windows logged, the last pending snapshot evaluated (unless a signal stopped the run), every
replica checked identical, the final checkpoint written, and `StopRequested` raised if a signal
ended the run early. A signal that comes once the last step is done ends nothing early: training
is complete, and the runner ends the run at once but as a completed one (`stop_after_training`:
the held-out split, an evaluation stopped before its first prompt, summary.json), so a rerun
finds a finished run, not a checkpoint with nothing left to train. The cadence (when to log and checkpoint) is the shared `Cadence`; between
steps both pipelines call `_observe` (monitor tick, periodic evaluation). The subclasses differ
only in how a step's batches and features arrive: `SyncTrainer` runs the target and the drafter
in turn on one thread, `AsyncTrainer` starts the pipeline threads and watches them.

What every trainer is built with (besides its `pipeline` node's own keys) is one `TrainerInputs`,
declared here once: the launcher fills it, preflight checks a trainer's signature for it, and a
new input is one field of it.

The monitor and the periodic evaluation are attached after construction (`attach`): the monitor
probes the trainer it watches (its windows, queues and counters), so it cannot exist first.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash.data.dataset import TokenDataset
from dflash.data.scheduler import BatchPlanner
from dflash.distributed import ProcessGroupInfo
from dflash.monitor.callbacks import TrainingCallbacks
from dflash.monitor.monitor import Monitor
from dflash.pipeline.cadence import Cadence
from dflash.pipeline.counters import WorkCounters
from dflash.pipeline.replicas import check_replicas_identical
from dflash.pipeline.roles import role_summary
from dflash.step.step import DrafterStep
from dflash.target.model import FrozenTarget
from dflash.trainer import state
from dflash.trainer.checkpoint import publish_last
from dflash.trainer.periodic_eval import PeriodicEval
from dflash.trainer.signals import StopRequested, StopSignal, compile_cut_by_stop, stop_on_signals
from dflash.trainer.state import CheckpointSettings, DataPosition

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class TrainerInputs:
    """What the launcher builds every trainer with (its `inputs=` argument), besides the keys of
    its `pipeline` option."""

    targets: list[FrozenTarget]  # one frozen target per target device
    step_fns: list[DrafterStep]  # one drafter replica (and its optimizer step) per drafter device
    dataset: TokenDataset
    planner: BatchPlanner  # the batch schedule
    stop_after: int  # the step training ends at
    log_every: int  # steps per log window
    checkpoints: CheckpointSettings
    process_group: ProcessGroupInfo = field(default_factory=ProcessGroupInfo)  # multi-node: rank 0 writes


# The keyword a trainer receives its TrainerInputs by (the launcher passes it, preflight checks it).
TRAINER_INPUTS = "inputs"


class Trainer(ABC):
    def __init__(self, *, inputs: TrainerInputs):
        self.inputs = inputs
        self.targets, self.target = inputs.targets, inputs.targets[0]
        self.step_fns = inputs.step_fns
        self.step_fn = inputs.step_fns[0]  # replicas are identical: replica 0 speaks for all
        self.drafter = self.step_fn.drafter
        self.dataset, self.planner = inputs.dataset, inputs.planner
        self.stop_after, self.checkpoints = inputs.stop_after, inputs.checkpoints
        self.cadence = Cadence(
            stop_after=inputs.stop_after,
            log_every=inputs.log_every,
            checkpoint_every=inputs.checkpoints.every_steps,
        )
        self.process_group = inputs.process_group
        self.position = DataPosition()
        self.monitor: Monitor | None = None
        self.periodic_eval: PeriodicEval | None = None
        self.callbacks = TrainingCallbacks()
        self.train_wall_s = 0.0  # from the start of training to its last step
        # From the start of training to the end of its first step in this process: with
        # torch.compile on, mostly the graphs' compilation (reported in the run summary).
        self.first_step_s: float | None = None
        self._started: float | None = None
        self.replica_digest: str | None = None  # what every replica of every process agreed on
        # The signal that came after the last step (training complete): the runner stops at once.
        self.stop_after_training: int | None = None
        self._first_step_hooks: list[Callable[[], None]] = []

    def at_first_step(self, hook: Callable[[], None]) -> None:
        """Call `hook` once, after this process's first training step (the first after a
        resume): every replica has run its first forward and backward by then."""
        self._first_step_hooks.append(hook)

    def _stepped(self, step: int) -> None:
        """After each optimizer step (replica 0's thread in the asynchronous pipeline)."""
        if self.first_step_s is None and self._started is not None:
            self.first_step_s = time.perf_counter() - self._started
            log.info(
                "first step done %.1f s after training started (compiled graphs included)", self.first_step_s
            )
        hooks, self._first_step_hooks = self._first_step_hooks, []
        for hook in hooks:
            hook()
        if self.periodic_eval is not None:
            self.periodic_eval.offer(step, self.drafter)

    def attach(
        self,
        *,
        monitor: Monitor,
        periodic_eval: PeriodicEval | None,
        callbacks: TrainingCallbacks | None = None,
    ) -> None:
        self.monitor, self.periodic_eval = monitor, periodic_eval
        self.callbacks = callbacks or TrainingCallbacks()

    # -- checkpoints -------------------------------------------------------------------------
    def restore(self, directory) -> None:
        self.position = state.restore(directory, self.step_fns)

    def save(self):
        if self.process_group.is_main:  # every rank holds the same weights; one writes them
            path = state.save(self.checkpoints, self.step_fn, self.position)
            if self.callbacks:
                self.callbacks.on_checkpoint(self.position.step, path)
                # `last` again, with the files the hooks added (the trackers' run records).
                publish_last(self.checkpoints.directory, path)
            return path
        return None

    # -- the lifecycle -----------------------------------------------------------------------
    @abstractmethod
    def prepare(self) -> None:
        """Build what training needs before the clock starts (run() calls it; idempotent)."""

    @abstractmethod
    def _train(self, stop: StopSignal) -> int | None:
        """Train until `stop_after` or a stop signal; return the signal number that ended
        training early, None when it completed."""

    def _final_position(self) -> DataPosition:
        return self.position

    def _observe(self, stop: StopSignal) -> None:
        """Between steps, on the thread that runs the lifecycle: the monitor's tick and the
        waiting snapshot's evaluation. Between its prompts the monitor keeps ticking (in the
        async pipeline training goes on meanwhile: its curves and progress bar do not freeze for
        the minutes an evaluation can take) and a signal ends it."""
        self.monitor.maybe_tick()
        if self.periodic_eval is not None:

            def between_prompts() -> bool:
                self.monitor.maybe_tick()
                return stop.is_set()

            self.periodic_eval.run_pending(should_stop=between_prompts)

    def run(self) -> None:
        self.prepare()
        started = self._started = time.perf_counter()
        # Held through the final checkpoint: a signal during the wind-down (a second Ctrl-C)
        # must not break off the checkpoint the first one asked for.
        with stop_on_signals() as stop:
            try:
                stopped_by = self._train(stop)
            except Exception as error:
                # Both pipelines have stopped every thread and stand at their last finished step.
                if not compile_cut_by_stop(error, stop):
                    raise
                stopped_by = stop.signum
            self.train_wall_s = time.perf_counter() - started
            self.monitor.maybe_tick(wait=True, final=True)
            if self.periodic_eval is not None and stopped_by is None:
                # the snapshot of the last steps, if still waiting
                self.periodic_eval.run_pending(should_stop=stop.is_set)
            self.position = self._final_position()
            self.replica_digest = check_replicas_identical(
                [s.drafter for s in self.step_fns], self.process_group
            )
            self.save()
        if stopped_by is None:
            stopped_by = stop.signum
        if stopped_by is not None and self.position.step >= self.stop_after:
            self.stop_after_training = stopped_by
        elif stopped_by is not None:
            raise StopRequested(stopped_by)

    # -- probe for the monitor ---------------------------------------------------------------
    @abstractmethod
    def _role_counters(self) -> tuple[list[WorkCounters], list[WorkCounters]]:
        """(the target workers' counters, the drafters')."""

    def role_summary(self) -> dict[str, float]:
        """The run's `roles/` figures: over the monitor's steady window (as its samples/s, no
        compilation in it) where the run had one, else over the whole run."""
        steady = self.monitor.steady_roles()
        if steady:
            return steady
        targets, drafters = self._role_counters()
        return role_summary(targets=targets, drafters=drafters, wall_s=self.train_wall_s)

    @abstractmethod
    def role_devices(self) -> dict[str, list[torch.device]]:
        """The devices each role runs on (the monitor's GPU telemetry names them)."""
