"""logger.sinks.tensorboard: TensorBoard event files in the run dir."""

from __future__ import annotations

import math

from dflash.monitor.sinks.base import OptionalLibrary, SinkContext, SinkDestination, refuse_unwritable_dir

TENSORBOARD = OptionalLibrary(module="tensorboard", extra="tensorboard", option="tensorboard")
SINK_KEY = "logger.sinks.tensorboard"


def check_tensorboard_destination(destination: SinkDestination) -> None:
    """logger.sinks.NAME of a TensorBoard sink, before any weights load: its event files' directory
    (`subdir`, under the run dir unless absolute) takes files. Left to the writer, a directory it
    cannot create is a traceback after the weights load."""
    directory = destination.run_dir / destination.settings["subdir"]
    refuse_unwritable_dir(directory, f"{destination.key}.subdir")


class TensorBoardSink:
    """logger=tensorboard: every row as TensorBoard scalars, event files in <run_dir>/tensorboard
    (`tensorboard --logdir outputs` shows every run; needs the `tensorboard` extra). Evaluation
    rows arrive at their snapshot's step, after rows of later steps: TensorBoard plots by step
    whatever the order. NaN/inf are left out, as metrics.jsonl writes them as null."""

    def __init__(self, *, context: SinkContext, subdir: str = "tensorboard", flush_secs: float = 30.0):
        # torch's writer needs the tensorboard package
        SummaryWriter = TENSORBOARD.load(SINK_KEY, "torch.utils.tensorboard").SummaryWriter
        self.log_dir = context.run_dir / subdir
        refuse_unwritable_dir(self.log_dir, f"{SINK_KEY}.subdir")  # checked before loading too
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)

    def close(self, ok: bool) -> None:
        self.writer.flush()
        self.writer.close()
