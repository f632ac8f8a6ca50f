"""`eval.every_steps`: speculative-decoding evaluation of drafter snapshots while training runs.

The training thread hands over a copy of the weights right after an optimizer step (a device
copy on its own stream, marked with an event: the pipeline pauses for that copy only). The
main thread evaluates the copy on the held-out prompts (the monitor ticking between them) and
logs `eval/tau`, per-benchmark `eval/<name>/tau`, the acceptance histogram and, with
`data.val_samples`, the held-out `val/` metrics at that step. In the async pipeline the target
and drafter threads keep running meanwhile (the frozen target is only read, so concurrent
forwards are safe), so that row can arrive after rows of later steps. If an evaluation is still pending when the next
snapshot is due, that snapshot is skipped and counted rather than queued. A stop signal ends
an evaluation at the next prompt, unlogged: a preempted job has seconds to write its checkpoint,
and the first evaluation of a run (graph captures, compiles) can take a minute.
"""

from __future__ import annotations

import copy
import logging
import queue
from collections.abc import Callable

import torch

from dflash.config.schema import EvalConfig
from dflash.drafters.backbone import DFlashDrafter
from dflash.eval.evaluate import Decoders, evaluate
from dflash.eval.prompt_sets import PromptSet
from dflash.monitor.monitor import Monitor
from dflash.target.model import FrozenTarget
from dflash.trainer.validation import Validation

log = logging.getLogger(__name__)


class PeriodicEval:
    def __init__(
        self,
        *,
        cfg: EvalConfig,
        target: FrozenTarget,
        drafter: DFlashDrafter,
        prompt_sets: list[PromptSet],
        monitor: Monitor,
        validation: Validation | None = None,
    ):
        """validation: the held-out samples, measured on each snapshot too (val/ metrics)."""
        self.cfg, self.target, self.prompt_sets = cfg, target, prompt_sets
        self.validation = validation
        self.every = cfg.every_steps
        # On the target's device: with gpu=split the training replicas live elsewhere.
        self.eval_drafter = copy.deepcopy(drafter).to(target.device).eval().requires_grad_(False)
        # One decoder for the whole run, built at the first evaluation: later snapshots are
        # loaded into it, so its graphs are captured (and compiled) once, not at every snapshot.
        self._decoders: Decoders | None = None
        self._snapshots: queue.Queue = queue.Queue(maxsize=1)
        self.skipped = 0
        self.evaluated_steps: list[int] = []
        self.monitor = monitor

    def offer(self, step: int, drafter: DFlashDrafter) -> None:
        """Training thread, right after optimizer step `step`."""
        if self.every <= 0 or step % self.every:
            return
        if self._snapshots.full():
            self.skipped += 1
            return
        with torch.no_grad():
            weights = {name: tensor.detach().clone() for name, tensor in drafter.state_dict().items()}
        ready = None
        if next(drafter.parameters()).is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._snapshots.put_nowait((step, weights, ready))

    def run_pending(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Main thread: evaluate the waiting snapshot, if any, and log its metrics; `should_stop`
        (a stop signal) abandons the evaluation between prompts."""
        try:
            step, weights, ready = self._snapshots.get_nowait()
        except queue.Empty:
            return
        if ready is not None:
            ready.synchronize()
        self.eval_drafter.load_state_dict(weights)
        if ready is not None:
            # The snapshot's memory belongs to the drafter stream's pool: finish reading it
            # before it is freed and that stream reuses it.
            torch.cuda.current_stream(self.target.device).synchronize()
        del weights
        subject = (self.target, self.eval_drafter, self.prompt_sets, self.cfg)
        if self._decoders is None:
            self._decoders = Decoders.for_prompts(*subject)
        report = evaluate(*subject, timing=False, should_stop=should_stop, decoders=self._decoders)
        if report.interrupted:
            log.warning("evaluation of the step %d snapshot abandoned: stop requested", step)
            return
        metrics = report.metrics()
        if self.validation is not None:
            metrics.update(self.validation.run(self.target, self.eval_drafter))
        metrics["eval/skipped_snapshots"] = float(self.skipped)
        self.monitor.log(metrics, step)
        self.evaluated_steps.append(step)
        log.info("eval at step %d: tau %.3f", step, metrics["eval/tau"])
