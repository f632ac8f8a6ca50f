"""A torch.compile backend that counts the graphs it compiles.

Batch shapes change from step to step (samples per batch, context length, anchors), so the
target's feature stack and the drafter's layers are compiled with dynamic shapes: a run compiles
a handful of graphs, not one per shape. The count is logged as each graph compiles and lands in
summary.json: a number that keeps growing means recompiles.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class CompileCounter:
    """A torch.compile backend: inductor, plus a count of the graphs handed to it."""

    def __init__(self, name: str):
        self.name = name
        self.graphs = 0
        self._lock = threading.Lock()  # replicas compile from their own threads

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx  # imported when the first graph compiles

        with self._lock:
            self.graphs += 1
            count = self.graphs
        log.info("%s: compiling graph %d (%d inputs)", self.name, count, len(example_inputs))
        return compile_fx(graph_module, example_inputs)
