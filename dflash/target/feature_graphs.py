"""The target's feature forward replayed from CUDA graphs, one per batch shape (`target.cuda_graphs`).

Why: a MoE hybrid target's compiled feature forward is bound by the host, not the GPU. At
Qwen3-Next-80B-A3B's shape (12 layers, 4 x 3072 tokens, fused experts, one graph per layer) an
H200 runs it in 63.1 ms while the host takes 58.7 ms only to issue it (benchmarks/RESULTS.md,
2026-12-04 (later)): flash-linear-attention's chunked rule and convolution and the experts'
routing launch their kernels from Python, about a millisecond of host time per Gated DeltaNet
layer. A replayed graph issues the whole forward in one launch, and the host is free for the
pipeline's other threads.

The rules that keep a replay equal to the forward it was captured from:
- A graph per exact input shape, captured after one plain call of that shape (which compiles and
  autotunes: nothing may be compiled or benchmarked inside a capture), on a stream of its own in
  thread-local capture mode (the pipeline's other threads keep using the GPU meanwhile).
- One memory pool for every shape's graph. Each graph's output stays allocated in the pool, so
  no other capture reuses it; the rest of a graph's memory is dead once it has run, and replays
  never overlap (below), so the graphs may share it in any order.
- The caller gets a copy of the graph's output: the next replay overwrites the graph's own.
- Calls from several threads (the target worker, validation) take a lock, and each call's work
  waits, on the GPU, for the previous call's copy: a replay never overwrites an input or an
  output another stream is still reading.
- Shapes beyond `max_shapes` run the plain forward (each graph keeps a static input and output
  of its shape); the first such shape is logged once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class _ShapeGraph:
    graph: torch.cuda.CUDAGraph
    static_input: torch.Tensor
    static_output: torch.Tensor


class FeatureGraphs:
    """`forward(input_ids) -> features`, replayed from a CUDA graph for up to `max_shapes`
    distinct input shapes, the plain forward for any other."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], *, max_shapes: int):
        if max_shapes < 1:
            raise ValueError(
                f"target.cuda_graphs={max_shapes}: graphs for at least one batch shape, or 0 for none"
            )
        self._forward = forward
        self._max_shapes = max_shapes
        self._graphs: dict[tuple[int, ...], _ShapeGraph] = {}
        self._pool = None
        self._lock = threading.Lock()
        self._last_call: torch.cuda.Event | None = None
        self._logged_overflow = False

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The input shapes that have a graph, in the order they were captured."""
        return list(self._graphs)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        with self._lock:
            stream = torch.cuda.current_stream(input_ids.device)
            if self._last_call is not None:
                stream.wait_event(self._last_call)
            shape = tuple(input_ids.shape)
            entry = self._graphs.get(shape)
            if entry is None and len(self._graphs) < self._max_shapes:
                entry = self._capture(input_ids)
            if entry is None:
                if not self._logged_overflow:
                    log.info(
                        "target.cuda_graphs=%d: batch shape %s runs without a graph (graphs kept for %s)",
                        self._max_shapes,
                        list(shape),
                        [list(s) for s in self._graphs],
                    )
                    self._logged_overflow = True
                out = self._forward(input_ids)
            else:
                entry.static_input.copy_(input_ids)
                entry.graph.replay()
                out = entry.static_output.clone()
            self._last_call = torch.cuda.Event()
            self._last_call.record(stream)
            return out

    def _capture(self, input_ids: torch.Tensor) -> _ShapeGraph:
        device = input_ids.device
        self._forward(input_ids)  # compiles and autotunes for this shape, outside the capture
        static_input = input_ids.clone()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        capture_stream = torch.cuda.Stream(device)
        capture_stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self._pool, stream=capture_stream, capture_error_mode="thread_local"
        ):
            static_output = self._forward(static_input)
        torch.cuda.current_stream(device).wait_stream(capture_stream)
        entry = _ShapeGraph(graph=graph, static_input=static_input, static_output=static_output)
        self._graphs[tuple(input_ids.shape)] = entry
        log.info("target.cuda_graphs: captured the feature forward for batch shape %s", list(input_ids.shape))
        return entry
