"""logger.sinks.progress: the run's progress bar."""

from __future__ import annotations

from dflash.monitor.sinks.base import SinkContext


class ProgressSink:
    """A progress bar for the whole run (tqdm, on stderr, only when it is a terminal), starting at
    the step a resumed run continues from."""

    def __init__(self, *, context: SinkContext):
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal (CI logs, redirected output).
        self.bar = tqdm(
            total=context.total_steps,
            initial=context.start_step,
            unit="step",
            dynamic_ncols=True,
            leave=True,
            disable=None,
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.bar.update(max(0, step - self.bar.n))

    def close(self, ok: bool) -> None:
        self.bar.close()
