"""logger.sinks.tensorboard: TensorBoard event files in the run dir."""

from __future__ import annotations

import math

from dflash.monitor.sinks.base import OptionalLibrary, SinkContext

TENSORBOARD = OptionalLibrary(module="tensorboard", extra="tensorboard", option="tensorboard")


class TensorBoardSink:
    """logger=tensorboard: every row as TensorBoard scalars, event files in <run_dir>/tensorboard
    (`tensorboard --logdir outputs` shows every run; needs the `tensorboard` extra). Evaluation
    rows arrive at their snapshot's step, after rows of later steps: TensorBoard plots by step
    whatever the order. NaN/inf are left out, as metrics.jsonl writes them as null."""

    def __init__(self, *, context: SinkContext, subdir: str = "tensorboard", flush_secs: float = 30.0):
        # torch's writer needs the tensorboard package
        SummaryWriter = TENSORBOARD.load("logger.sinks.tensorboard", "torch.utils.tensorboard").SummaryWriter
        self.log_dir = context.run_dir / subdir
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)

    def close(self, ok: bool) -> None:
        self.writer.flush()
        self.writer.close()
