"""Per-thread detector of GPU->CPU synchronizations, built on torch.cuda.set_sync_debug_mode.

In "warn" mode CUDA-synchronizing calls (.item(), .cpu(), .tolist(), nonzero, blocking copies...)
emit a warning from the thread that made them; this detector records the thread name and the
stack of each one, so a test can demand zero syncs in the target and drafter threads while the
monitor and the main thread still read what they need. Syncs made while torch.compile builds a
graph are told apart: a run pays them once per compiled graph, not per step.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import torch

# Frames that only exist while torch.compile builds a graph (dynamo tracing a frame, inductor
# compiling a forward or, lazily at the first backward, a backward graph). A compiled graph
# running does not pass through them.
_COMPILING_FRAMES = ("torch/_dynamo/convert_frame.py", "torch/_inductor/compile_fx.py")


@dataclass
class SyncEvent:
    thread: str
    message: str
    stack: str
    during_compilation: bool = False  # a one-time compile step (e.g. constant folding)


@dataclass
class SyncDetector:
    events: list[SyncEvent] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> SyncDetector:
        self._previous_mode = torch.cuda.get_sync_debug_mode()
        self._previous_show = warnings.showwarning
        self._filters = warnings.catch_warnings()
        self._filters.__enter__()
        warnings.filterwarnings("always", message=".*synchroniz.*")

        def show(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if "synchroniz" not in text.lower():
                return self._previous_show(message, category, filename, lineno, file, line)
            compiling = any(frame.filename.endswith(_COMPILING_FRAMES) for frame in traceback.extract_stack())
            with self._lock:
                self.events.append(
                    SyncEvent(
                        threading.current_thread().name,
                        text,
                        "".join(traceback.format_stack(limit=12)),
                        during_compilation=compiling,
                    )
                )

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode(self._previous_mode)
        warnings.showwarning = self._previous_show
        self._filters.__exit__(*exc)

    def by_thread(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for event in self.events:
            counts[event.thread] += 1
        return dict(counts)

    def in_threads(self, prefix: str, *, compiling: bool = False) -> list[SyncEvent]:
        """Events of threads named `prefix`*: those of running code, or (compiling=True) those
        torch.compile made while building a graph, which a run pays once per graph."""
        return [e for e in self.events if e.thread.startswith(prefix) and e.during_compilation == compiling]
