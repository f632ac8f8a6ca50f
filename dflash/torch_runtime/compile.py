"""torch.compile for a process whose threads all call compiled code, and a backend that counts
the graphs it compiles.

One lock for every call into a compiled function (`compile_shared`) and every backward through
one (`compiled_calls`). While a thread compiles, torch traces the graph with torch.fx and sets
a process-wide "FX tracing" flag (torch.fx._symbolic_trace, not per thread); any other thread
that enters a compiled function meanwhile fails with "Detected that you are using FX to
symbolically trace a dynamo-optimized function" (torch._dynamo.eval_frame). The asynchronous
pipeline calls compiled code from several threads — drafter replicas, the target worker,
validation and periodic evaluation in the main thread — and a recompile for a new batch shape
can come at any step: a SmolLM2 run on an H200 lost its drafter thread to this during the first
periodic evaluation after a resume. With the lock the other threads wait for the compile instead.
It is held for the host side of a call only (kernel launches are asynchronous) and is
uncontended except while another thread is in compiled code, which the GIL mostly serialises
anyway.

Batch shapes change from step to step (samples per batch, context length, anchors), so the
target's feature stack and the drafter's layers are compiled with dynamic shapes: a run compiles
a handful of graphs, not one per shape. `CompileCounter` logs each graph as it compiles and the
count lands in summary.json: a number that keeps growing means recompiles.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_COMPILED_CALLS = threading.RLock()  # re-entrant: compiled code may call compiled code


def compiled_calls() -> threading.RLock:
    """The lock to hold around anything that runs compiled code not wrapped by `compile_shared`
    (a backward through compiled graphs: its first call compiles the backward graph). A backward
    runs on autograd's device threads while the caller holds this lock, so nothing in a backward
    may call a `compile_shared` function (recomputation under activation checkpointing would):
    it would wait for the lock forever."""
    return _COMPILED_CALLS


def compile_shared(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """torch.compile(fn, **options), called under the process-wide compiled-code lock."""
    compiled = torch.compile(fn, **options)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _COMPILED_CALLS:
            return compiled(*args, **kwargs)

    return call


class CompileCounter:
    """A torch.compile backend: inductor (or `backend`), plus a count of the graphs handed to it."""

    def __init__(self, name: str, backend: Callable[..., Any] | None = None):
        self.name = name
        self.graphs = 0
        self._backend = backend  # None: inductor; tests count graphs with a cheaper one
        self._lock = threading.Lock()  # replicas compile from their own threads
        self._settled = False

    def settle(self) -> None:
        """Training has taken its first step: a graph from now on is compiled mid-run, with
        every thread that runs compiled code waiting for it, and is logged as a warning."""
        self._settled = True

    def __call__(self, graph_module, example_inputs):
        with self._lock:
            self.graphs += 1
            count = self.graphs
        if self._settled:
            log.warning(
                "%s: compiling graph %d mid-run, for a batch shape the graphs so far do not cover; "
                "the pipeline waits until it is built (python scripts/replay_compiles.py names the "
                "guard that failed)",
                self.name,
                count,
            )
        else:
            log.info("%s: compiling graph %d (%d inputs)", self.name, count, len(example_inputs))
        if self._backend is not None:
            return self._backend(graph_module, example_inputs)
        from torch._inductor.compile_fx import compile_fx  # imported when the first graph compiles

        return compile_fx(graph_module, example_inputs)
