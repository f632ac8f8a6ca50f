"""DrafterLoop: one thread per drafter replica, and the gradient sync that keeps replicas identical.

Replicas are data parallel: every step each one trains on its own batch, then the replicas sum
their gradients of the weighted-CE numerator and their weights (in-process, then across nodes
through torch.distributed when it is initialized), and all divide by the same total. Replicas
start from the same weights and apply the same update, so they stay identical.

Nothing in the step reads a device value on the host; metrics leave through `StepMetrics.publish`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import nullcontext

import torch
import torch.distributed as dist

from dflash.pipeline.cadence import Cadence
from dflash.pipeline.counters import DeviceSpan, WorkCounters
from dflash.pipeline.queues import HiddenStateQueue
from dflash.pipeline.target_worker import HiddenStatePacket
from dflash.step.metrics import MetricWindow
from dflash.step.step import DrafterStep


def _ready_event(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on this thread's stream for `device` (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class ReplicaGradSync:
    """Sums per-replica vectors over the drafter replicas of this process and over processes
    (when torch.distributed is initialized), with a barrier per exchange: the gradients every
    step, the metric windows every log window.

    On GPU every replica works on its own stream, so the hand-over is ordered with CUDA events,
    never a host sync: the reduction waits for each replica's vector, each replica waits for the
    result, and record_stream keeps memory from being reused while another stream still reads it.
    The collective runs in one thread (the last replica to arrive), so every process issues its
    collectives in the same order.
    """

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self._slots: list[tuple[torch.Tensor, torch.cuda.Event | None] | None] = [None] * num_replicas
        self._result: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._across_replicas = True  # what the pending exchange sums (set before the barrier)
        self._barrier = threading.Barrier(num_replicas, action=self._reduce)
        self._checkpoint_barrier = threading.Barrier(num_replicas)

    def _reduce(self) -> None:
        # Runs in one thread (the last to arrive) once every replica has deposited its vector.
        home = self._slots[0][0].device
        stream = torch.cuda.current_stream(home) if home.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for flat, ready in self._slots:
                if ready is not None:
                    # A copy from another GPU runs on that device's current stream in this
                    # thread, so it too must wait for the replica's vector.
                    for waiting in {stream, torch.cuda.current_stream(flat.device)}:
                        waiting.wait_event(ready)
                    flat.record_stream(torch.cuda.current_stream(flat.device))
            vectors = [self._slots[0][0]] + [flat.to(home, non_blocking=True) for flat, _ in self._slots[1:]]
            if self._across_replicas:
                result = vectors[0].clone()
                for vector in vectors[1:]:
                    result += vector
            else:
                result = torch.stack(vectors)  # row i: replica i, summed over processes below
            if _distributed():
                dist.all_reduce(result, op=dist.ReduceOp.SUM)
            self._result = (result, _ready_event(home))

    def _exchange(self, replica: int, flat: torch.Tensor, across_replicas: bool) -> torch.Tensor:
        self._slots[replica] = (flat, _ready_event(flat.device))
        self._across_replicas = across_replicas  # every replica sets the same value
        self._barrier.wait()  # the last replica to arrive runs _reduce
        result, done = self._result
        self._barrier.wait()  # everyone holds the result before the next exchange replaces it
        if done is not None:
            torch.cuda.current_stream(flat.device).wait_event(done)
            # The stream that reads it here: this replica's own, or, when the result lives on
            # another GPU, that GPU's stream that runs the copy (a cross-device copy orders
            # itself after this replica's stream, so it too sees the finished result).
            result.record_stream(torch.cuda.current_stream(result.device))
        result = result if across_replicas else result[replica]
        return result.to(flat.device, non_blocking=True)

    def all_reduce(self, replica: int, drafter: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
        """Replace this replica's grads by the sum over replicas; returns the summed weight."""
        if self.num_replicas == 1 and not _distributed():
            return weight
        params = list(drafter.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [weight.reshape(1).to(grads[0].dtype)])
        total = self._exchange(replica, flat, across_replicas=True)
        offset = 0
        for param in params:
            count = param.numel()
            param.grad = total[offset : offset + count].view_as(param).clone()
            offset += count
        return total[offset]

    def sum_over_processes(self, replica: int, sums: torch.Tensor) -> torch.Tensor:
        """Replica i's metric sums added up over replica i of every process, so the main process
        logs the loss of the whole job, not of its own share of the batches."""
        if not _distributed():
            return sums
        return self._exchange(replica, sums, across_replicas=False)

    def checkpoint_rendezvous(self) -> None:
        """Every replica stops here around a checkpoint, so replica 0 saves a consistent state."""
        self._checkpoint_barrier.wait()

    def abort(self) -> None:
        self._barrier.abort()
        self._checkpoint_barrier.abort()


class DrafterLoop:
    def __init__(
        self,
        *,
        replica: int,
        step_fn: DrafterStep,
        inbox: HiddenStateQueue[HiddenStatePacket],
        grad_sync: ReplicaGradSync,
        start_step: int,
        cadence: Cadence,
        on_consumed,
        on_checkpoint,
        fault_at_step: int | None = None,
        on_step=None,
    ):
        self.replica, self.step_fn, self.inbox, self.grad_sync = replica, step_fn, inbox, grad_sync
        self.step = start_step
        self.cadence = cadence
        self.on_consumed = on_consumed  # called with the batch seq once its update is applied
        self.on_checkpoint = on_checkpoint
        self.fault_at_step = fault_at_step
        self.on_step = on_step  # replica 0 calls it with the step number after each update
        self.device = step_fn.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # gpu=split: features come from a target GPU; this loop copies them over on a stream of
        # its own on that GPU (not the default stream, which evaluation may be using).
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.stop_requested = threading.Event()
        self._windows: deque[MetricWindow] = deque()
        self._lock = threading.Lock()
        self.counters = WorkCounters(f"drafter{replica}", counts_anchors=True)

    def _receive(self, packet: HiddenStatePacket) -> torch.Tensor:
        """The packet's features on this replica's device, ordered after the target's forward
        by CUDA events: no host sync, whichever GPU they were computed on."""
        features = packet.features
        if packet.ready is None:  # CPU: computed synchronously
            return features.to(self.device)
        if features.device == self.device:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(packet.ready)
            features.record_stream(stream)  # allocated on the target's stream, read on ours
            return features
        copy_stream = self._copy_streams.get(features.device)
        if copy_stream is None:
            copy_stream = self._copy_streams[features.device] = torch.cuda.Stream(features.device)
        copy_stream.wait_event(packet.ready)
        features.record_stream(copy_stream)
        with torch.cuda.stream(copy_stream):
            # A cross-GPU copy runs on the source GPU's current stream (copy_stream) and makes
            # this device's current stream (the replica's) wait for it.
            return features.to(self.device, non_blocking=True)

    def _all_reduce(self, drafter: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
        return self.grad_sync.all_reduce(self.replica, drafter, weight)

    def drain_windows(self, wait: bool = False) -> list[MetricWindow]:
        """Completed metric windows, oldest first. Never waits on the device unless `wait`
        (once the threads have stopped, so the last window is not lost)."""
        with self._lock:
            done = []
            while self._windows and (wait or self._windows[0].is_ready()):
                window = self._windows.popleft()
                if window.ready is not None:
                    window.ready.synchronize()
                done.append(window)
            return done

    def run(self) -> None:
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with stream_ctx:
            while self.step < self.cadence.stop_after and not self.stop_requested.is_set():
                started = time.perf_counter()
                packet = self.inbox.get()  # raises QueueClosed at shutdown
                fetched = time.perf_counter()
                if self.fault_at_step is not None and self.step == self.fault_at_step:
                    raise RuntimeError(
                        f"injected drafter fault at step {self.step} on replica {self.replica}"
                    )
                features = self._receive(packet)
                span = DeviceSpan.start(self.device)
                step_fn = self.step_fn
                anchors = step_fn(packet.batch, features, self.step, reduce_gradients=self._all_reduce)
                span.stop()
                self.step += 1
                self.on_consumed(packet.seq)
                if self.cadence.logs_at(self.step):
                    window = step_fn.metrics.publish(
                        self.step,
                        step_fn.lr,
                        reduce=lambda sums: self.grad_sync.sum_over_processes(self.replica, sums),
                    )
                    with self._lock:
                        self._windows.append(window)
                if self.replica == 0 and self.on_step is not None:
                    self.on_step(self.step)
                self.counters.record(
                    packet.batch,
                    waited_s=fetched - started,
                    busy_s=time.perf_counter() - fetched,
                    anchors=anchors,
                    span=span,
                )
                if self.cadence.checkpoints_at(self.step):
                    self.grad_sync.checkpoint_rendezvous()
                    if self.replica == 0:
                        self.on_checkpoint(self.step)
                    self.grad_sync.checkpoint_rendezvous()
