"""A slow sink (a tracker on the network) on its own thread, so it never holds up training, and
the `logger.sinks` factory that puts a sink class there (background_factory)."""

from __future__ import annotations

import inspect
import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash.monitor.sinks.base import MetricSink

log = logging.getLogger(__name__)

# Ticks a background sink holds for its thread, unless its entry's `queue_size` says otherwise.
QUEUE_SIZE = 100


class BackgroundSink:
    """Runs a slow sink (W&B) on its own thread behind a bounded queue that drops the oldest tick.

    The monitor only enqueues, so a stalled network can never hold up training; dropped ticks are
    counted and reported as `monitor/<name>_dropped` in later ticks.
    """

    def __init__(self, name: str, sink: MetricSink, *, queue_size: int, close_timeout_s: float):
        self.name, self.sink = name, sink
        self.close_timeout_s = close_timeout_s
        self._items: deque = deque()
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=f"dflash-sink-{name}", daemon=True)
        self._thread.start()

    def health(self) -> dict[str, float]:
        return {f"monitor/{self.name}_dropped": float(self.dropped)}

    def on_checkpoint(self, step: int, path: Path) -> None:
        """The wrapped sink's checkpoint hook, where it has one (on the checkpoint's thread)."""
        hook = getattr(self.sink, "on_checkpoint", None)
        if hook is not None:
            hook(step, path)

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The wrapped sink's summary hook, where it has one (on the caller's thread)."""
        hook = getattr(self.sink, "log_summary", None)
        if hook is not None:
            hook(summary)

    def log(self, metrics: dict[str, float], step: int) -> None:
        with self._cond:
            if len(self._items) >= self._queue_size:
                self._items.popleft()
                self.dropped += 1
            self._items.append((dict(metrics), step))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    return
                metrics, step = self._items.popleft()
            try:
                self.sink.log(metrics, step)
            except Exception as exc:  # a sink failure must not take the run down
                log.warning("%s sink: dropped a tick (%s)", self.name, exc)

    def close(self, ok: bool) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning(
                "%s sink: still busy after %.0f s; closing with ticks unsent", self.name, self.close_timeout_s
            )
        self.sink.close(ok)


def background_factory(name: str, sink_class: type) -> Callable[..., BackgroundSink]:
    """The `logger.sinks` factory of a slow sink: `sink_class` built with the entry's settings and
    run on its own thread (BackgroundSink), `queue_size` ticks deep; the class's own
    `finish_timeout_s` also bounds the wait for that thread at close.

    The factory's signature is the class's plus `queue_size`, so the checks before any weights
    load (dflash/config/components.py: check_buildable) refuse a key the class does not take,
    as they would for the class itself."""
    queue_size = inspect.Parameter(
        "queue_size", inspect.Parameter.KEYWORD_ONLY, default=QUEUE_SIZE, annotation="int"
    )
    signature = inspect.signature(sink_class)
    signature = signature.replace(parameters=[*signature.parameters.values(), queue_size])

    def factory(**arguments: Any) -> BackgroundSink:
        bound = signature.bind(**arguments)  # a key the class does not take: TypeError, named
        bound.apply_defaults()
        settings = dict(bound.arguments)
        queued = settings.pop("queue_size")
        return BackgroundSink(
            name, sink_class(**settings), queue_size=queued, close_timeout_s=settings["finish_timeout_s"]
        )

    factory.__signature__ = signature
    factory.__name__ = factory.__qualname__ = f"{name}_sink"
    factory.__module__ = sink_class.__module__
    factory.__doc__ = (
        f"logger.sinks.{name}: a {sink_class.__name__} on its own thread, `queue_size` ticks deep (the "
        "oldest dropped, and counted, when it stalls), given `finish_timeout_s` to finish."
    )
    return factory
