"""logger.sinks.jsonl: <run_dir>/metrics.jsonl, the record every other tool reads."""

from __future__ import annotations

import json
import math

from dflash.monitor.sinks.base import SinkContext


class JsonlSink:
    """<run_dir>/metrics.jsonl: one JSON object per log step, flushed so readers see it at once."""

    def __init__(self, *, context: SinkContext):
        path = context.run_dir / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # NaN/inf are not JSON: written as null so every line stays parseable by later tools.
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self, ok: bool) -> None:
        self._file.close()
