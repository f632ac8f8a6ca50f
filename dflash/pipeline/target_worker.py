"""TargetWorker: one thread per target device running the frozen target forward."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from dflash.pipeline.counters import DeviceSpan, WorkCounters
from dflash.pipeline.prefetch import Dispatched
from dflash.pipeline.queues import HiddenStateQueue, OrderedQueue
from dflash.target.model import FrozenTarget


@dataclass
class HiddenStatePacket:
    seq: int
    order: int  # the batch's dispatch index (see Dispatched)
    batch: object  # dflash.data.collate.Batch (host tensors: ids, masks, plan)
    features: torch.Tensor  # [B, S, n_feat * H] on the target device (the drafter moves it)
    ready: torch.cuda.Event | None  # recorded on the target stream after the forward


class TargetWorker:
    def __init__(
        self,
        *,
        index: int,
        target: FrozenTarget,
        inbox: OrderedQueue[Dispatched],
        outbox: HiddenStateQueue[HiddenStatePacket],
        fault_at_batch: int | None = None,
    ):
        self.index, self.target, self.inbox, self.outbox = index, target, inbox, outbox
        self.device = target.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.fault_at_batch = fault_at_batch  # tests: raise at this batch to exercise failure paths
        self.counters = WorkCounters(f"target{index}")

    def warm_up(self, shapes: list[tuple[int, int]]) -> None:
        """Run every bucket's largest shape once before the clock starts (kernel autotuning, FLA)."""
        for batch_size, seq_len in shapes:
            ids = torch.zeros((batch_size, seq_len), dtype=torch.int64, device=self.device)
            self.target.features(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # once, before the pipeline starts: not the hot path

    def run(self) -> None:
        stream_ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with stream_ctx:
            while True:
                started = time.perf_counter()
                item = self.inbox.get()  # raises QueueClosed at shutdown
                fetched = time.perf_counter()
                if self.fault_at_batch is not None and self.counters.batches == self.fault_at_batch:
                    raise RuntimeError(
                        f"injected target fault at batch {self.counters.batches} on worker {self.index}"
                    )
                batch = item.batch
                span = DeviceSpan.start(self.device)
                features = self.target.features(batch.input_ids.to(self.device, non_blocking=True))
                span.stop()
                ready = None
                if self.stream is not None:
                    ready = torch.cuda.Event()
                    ready.record(self.stream)
                packet = HiddenStatePacket(item.seq, item.order, batch, features, ready)
                done = time.perf_counter()
                self.counters.record(batch, waited_s=fetched - started, busy_s=done - fetched, span=span)
                self.outbox.put(item.order, packet, batch.plan.bucket)
