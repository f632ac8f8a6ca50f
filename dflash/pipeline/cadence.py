"""When a training loop closes a metric window, writes a periodic checkpoint and stops.

Written once: the sync trainer and every asynchronous drafter loop ask the same object, so the
two pipelines log and checkpoint at the same steps (the sync-vs-async tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Cadence:
    stop_after: int  # the last step of this run (train.total_steps, or debug.max_steps)
    log_every: int  # logger.every_steps
    checkpoint_every: int  # checkpoint.every_steps

    def logs_at(self, step: int) -> bool:
        """A metric window closes every `log_every` steps and at the last step; the steps left
        after the last full window join it (docs/observability.md "Windows"): a run of 774 steps
        logged every 10 closes its last window at 774 with 14 steps, not at 770 and again at 774
        with 4, so no row (and no final figure of the summary) comes from a shorter window."""
        if step == self.stop_after:
            return True
        return step % self.log_every == 0 and self.stop_after - step >= self.log_every

    def checkpoints_at(self, step: int) -> bool:
        """Periodic checkpoints; the last step's checkpoint is written when the run ends."""
        return step % self.checkpoint_every == 0 and step != self.stop_after
