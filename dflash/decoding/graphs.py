"""CUDA-graph replay of a tensor function, one graph per input shape (and static arguments).

A decode step of a small model is a few hundred kernels of microseconds each: launched one by
one from Python, the GPU waits on the host. Captured once as a CUDA graph and replayed, the
whole step is one launch. We capture explicitly (torch.cuda.CUDAGraph) rather than through
torch.compile(mode="reduce-overhead"): the step functions write into caches that live outside
the graph (static KV caches), the shapes a run needs are few and known (batch, new tokens,
attended cache length bucket), and an explicit key makes "which shapes were captured" a number
the caller can read (`captures`) instead of a recompilation it cannot see.

Contract for a captured function: its tensor arguments are copied into static buffers before
each replay; it must not read tensors created before the call other than module state (weights,
caches); its outputs are static buffers overwritten by the next replay of the same shape, so the
caller reads them before calling again. Off CUDA, or with graphs disabled, calls run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Key = tuple[Any, ...]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: Any


class GraphedFunction:
    """`fn(*tensors, **static)` replayed from a CUDA graph per (shapes, dtypes, static kwargs)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        enabled: bool,
        pool: Any = None,
        stream: torch.cuda.Stream | None = None,
        warmup_calls: int = 2,
    ):
        # A function that calls torch.compile'd code is captured the same way: the warm-up
        # calls compile it, the capture records the kernels it launches.
        self.fn = fn
        self.enabled = enabled
        self.pool = pool
        # The stream the graphs are captured on (None: torch.cuda.graph's one class-wide stream).
        # cuBLAS scratch memory is bound per stream and its address recorded in each graph, so
        # graphs captured on one stream share it: two of them replayed at once on different
        # streams write the same scratch (pytorch/pytorch#193402). Graphs that may replay
        # concurrently (dflash.decoding.side_by_side) need capture streams of their own.
        self.stream = stream
        self.warmup_calls = warmup_calls
        self.graphs: dict[Key, _Captured] = {}

    @property
    def captures(self) -> int:
        return len(self.graphs)

    def __call__(self, *tensors: torch.Tensor, **static: Any) -> Any:
        if not self.enabled:
            return self.fn(*tensors, **static)
        key = (tuple((t.shape, t.dtype) for t in tensors), tuple(sorted(static.items())))
        captured = self.graphs.get(key)
        if captured is None:
            captured = self.graphs[key] = self._capture(tensors, static)
        for buffer, value in zip(captured.inputs, tensors):
            buffer.copy_(value, non_blocking=True)
        captured.graph.replay()
        return captured.outputs

    def _capture(self, tensors: tuple[torch.Tensor, ...], static: dict[str, Any]) -> _Captured:
        inputs = [t.detach().clone() for t in tensors]
        # Warm-up on a side stream (cuBLAS workspaces, lazy inits), as torch.cuda.graphs asks.
        # The step functions are idempotent for the same inputs (a cache write stores the same
        # keys at the same positions), so running them before the capture changes nothing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_calls):
                self.fn(*inputs, **static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads may keep launching work meanwhile (an evaluation during
        # asynchronous training captures while the target worker runs).
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            outputs = self.fn(*inputs, **static)
        return _Captured(graph, inputs, outputs)


def graphs_enabled(requested: bool | None, device: torch.device) -> bool:
    """null: on CUDA. Graphs need CUDA: off CUDA every call runs eagerly whatever was asked."""
    return device.type == "cuda" if requested is None else bool(requested) and device.type == "cuda"
