"""The asynchronous trainer (`pipeline=async`): starts the pipeline threads, watches them from the
main thread, and stops everything on completion, failure or a signal; the lifecycle around that
(signals, final checkpoint, replica check) is `Trainer`'s.

    feed thread ─► collate workers ─► per-device queues ─► TargetWorker x T ─► HiddenStateQueue ─► DrafterLoop x D

Failure rule: the first exception in any thread is recorded, every queue is closed and the
gradient barrier aborted (so no thread stays blocked), all threads are joined, and the main
thread re-raises that exception with its original traceback. No thread outlives `run()`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass

import torch

from dflash.pipeline.counters import WorkCounters
from dflash.pipeline.drafter_loop import DrafterLoop, ReplicaGradSync
from dflash.pipeline.prefetch import BatchPrefetcher
from dflash.pipeline.queues import HiddenStateQueue, QueueClosed
from dflash.pipeline.target_worker import TargetWorker
from dflash.step.metrics import MetricWindow
from dflash.trainer.lifecycle import Trainer, TrainerInputs
from dflash.trainer.signals import StopSignal
from dflash.trainer.state import DataPosition

log = logging.getLogger(__name__)


class ConsumedTracker:
    """Which schedule positions have been trained on, for exact resumes with reordering."""

    def __init__(self, position: DataPosition):
        self._lock = threading.Lock()
        self.next_seq = position.next_seq
        self.done = set(position.done_beyond)

    def mark(self, seq: int) -> None:
        with self._lock:
            self.done.add(seq)
            while self.next_seq in self.done:
                self.done.remove(self.next_seq)
                self.next_seq += 1

    def position(self, step: int) -> DataPosition:
        with self._lock:
            return DataPosition(self.next_seq, step, sorted(self.done))


@dataclass
class FaultInjection:
    """Tests only: make a target worker or a drafter raise at a given batch / step."""

    target_at_batch: int | None = None
    drafter_at_step: int | None = None


def thread_stacks(threads: list[threading.Thread], frames_per_thread: int = 12) -> str:
    """Each thread's name and the innermost frames of its stack, as a traceback prints them."""
    current = sys._current_frames()
    parts = []
    for thread in threads:
        frame = current.get(thread.ident)
        if frame is not None:
            stack = "".join(traceback.format_stack(frame)[-frames_per_thread:])
            parts.append(f"--- {thread.name}\n{stack.rstrip()}")
    return "\n".join(parts)


class AsyncTrainer(Trainer):
    def __init__(
        self,
        *,
        inputs: TrainerInputs,
        hs_queue_size: int = 8,
        prefetch_depth: int = 4,
        num_workers: int = 2,
        warmup: bool = True,
        poll_interval_s: float = 0.05,
        shutdown_timeout_s: float = 10.0,
        stop_report_s: float = 300.0,
        faults: FaultInjection | None = None,
    ):
        """The stages' settings are pipeline=async's (conf/pipeline/async.yaml, documented in
        its schema, AsyncPipelineConfig)."""
        super().__init__(inputs=inputs)
        self.hs_queue_size, self.prefetch_depth, self.num_workers = hs_queue_size, prefetch_depth, num_workers
        self.warmup, self.poll_interval_s, self.shutdown_timeout_s = (
            warmup,
            poll_interval_s,
            shutdown_timeout_s,
        )
        self.stop_report_s = stop_report_s
        self.faults = faults or FaultInjection()
        self._pending: dict[int, dict[int, MetricWindow]] = defaultdict(dict)
        self._failure: tuple[str, BaseException] | None = None
        self._failure_lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.prefetcher: BatchPrefetcher | None = None

    # -- construction ------------------------------------------------------------------------
    def _build(self) -> None:
        num_drafters = len(self.step_fns)
        start = self.position
        needed = (self.stop_after - start.step) * num_drafters
        self.tracker = ConsumedTracker(start)
        self.prefetcher = BatchPrefetcher(
            dataset=self.dataset,
            planner=self.planner,
            target_devices=[t.device for t in self.targets],
            num_workers=self.num_workers,
            depth_per_device=self.prefetch_depth,
            start_seq=start.next_seq,
            end_seq=start.next_seq + needed + len(start.done_beyond),
            skip_seqs=set(start.done_beyond),
            rank=self.process_group.rank,
            world_size=self.process_group.world_size,
        )
        self.hs_queue = HiddenStateQueue(self.hs_queue_size, self.planner.num_buckets)
        self.workers = [
            TargetWorker(
                index=i,
                target=target,
                inbox=self.prefetcher.device_queues[i],
                outbox=self.hs_queue,
                fault_at_batch=self.faults.target_at_batch,
            )
            for i, target in enumerate(self.targets)
        ]
        self.grad_sync = ReplicaGradSync(num_drafters)
        self.loops = [
            DrafterLoop(
                replica=i,
                step_fn=step_fn,
                inbox=self.hs_queue,
                grad_sync=self.grad_sync,
                start_step=start.step,
                cadence=self.cadence,
                on_consumed=self.tracker.mark,
                on_checkpoint=self._checkpoint_from_replica0,
                fault_at_step=self.faults.drafter_at_step,
                on_step=self._after_step,
            )
            for i, step_fn in enumerate(self.step_fns)
        ]

    def _warm_up(self) -> None:
        # The shapes of the first epoch's largest batch per bucket, not every bucket edge at the
        # token budget: with exact-shape graphs (target.compile_dynamic=null) data of one shape
        # then compiles one graph, the one training uses; with symbolic shapes, buckets no sample
        # falls in compile nothing.
        shapes = self.planner.largest_batch_shapes(0)
        started = time.perf_counter()
        for worker in self.workers:
            worker.warm_up(shapes)
        log.info(
            "warm-up: %d target shapes on %d device(s) in %.1f s",
            len(shapes),
            len(self.workers),
            time.perf_counter() - started,
        )

    # -- threads -----------------------------------------------------------------------------
    def _spawn(self, name: str, fn) -> None:
        def body() -> None:
            try:
                fn()
            except (QueueClosed, threading.BrokenBarrierError):
                pass  # shutdown, or another thread failed first
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the main thread
                self._fail(name, exc)

        thread = threading.Thread(target=body, name=f"dflash-{name}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _fail(self, name: str, exc: BaseException) -> None:
        with self._failure_lock:
            if self._failure is None:
                exc.add_note(f"(raised in pipeline thread {name!r})")
                self._failure = (name, exc)
        self._close_everything()

    def _close_everything(self) -> None:
        self.prefetcher.close()
        self.hs_queue.close()
        self.grad_sync.abort()
        for loop in self.loops:
            loop.stop_requested.set()

    def _join_all(self) -> None:
        deadline = time.perf_counter() + self.shutdown_timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.perf_counter()))
        alive = [t.name for t in self.threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"pipeline threads did not stop within {self.shutdown_timeout_s} s: {alive}")

    def _after_step(self, step: int) -> None:
        # Drafter thread 0, between steps: the periodic evaluation's snapshot is a device copy,
        # nothing waits on it.
        self._stepped(step)

    def _checkpoint_from_replica0(self, step: int) -> None:
        # Runs in drafter thread 0 while every replica waits at the checkpoint barrier.
        self.position = self.tracker.position(step)
        self.save()

    # -- probe for the monitor ---------------------------------------------------------------
    def completed_windows(self, wait: bool) -> list[list[MetricWindow]]:
        """Windows every replica has published, by step (replicas publish at the same steps)."""
        for loop in self.loops:
            for window in loop.drain_windows(wait):
                self._pending[window.end_step][loop.replica] = window
        groups = []
        for step in sorted(self._pending):
            if len(self._pending[step]) < len(self.loops):
                break
            by_replica = self._pending.pop(step)
            groups.append([by_replica[i] for i in range(len(self.loops))])
        return groups

    def pipeline_stats(self) -> dict[str, float]:
        stats = self.prefetcher.get_batch_stats()
        stats["queue/hs_depth"] = float(self.hs_queue.qsize())
        stats["queue/hs_fill"] = self.hs_queue.fill_ratio()
        for bucket, depth in enumerate(self.hs_queue.bucket_sizes()):
            stats[f"queue/hs_bucket_{bucket}_depth"] = float(depth)
        for index, device_queue in enumerate(self.prefetcher.device_queues):
            stats[f"queue/prefetch_target{index}_depth"] = float(device_queue.qsize())
        stats["queue/producer_wait_total_s"] = self.hs_queue.producer_wait_s
        stats["queue/consumer_wait_total_s"] = self.hs_queue.consumer_wait_s
        for worker in [*self.workers, *self.loops]:
            stats.update(worker.counters.stats())
        return stats

    def _role_counters(self) -> tuple[list[WorkCounters], list[WorkCounters]]:
        return [w.counters for w in self.workers], [loop.counters for loop in self.loops]

    def role_devices(self) -> dict[str, list[torch.device]]:
        return {"target": [t.device for t in self.targets], "drafter": [s.device for s in self.step_fns]}

    def prepare(self) -> None:
        """Build the pipeline and warm the target up (once; run() calls it if nobody did)."""
        if self.prefetcher is None:
            self._build()
            if self.warmup:
                self._warm_up()

    def _train(self, stop: StopSignal) -> int | None:
        stop_signum = None
        self._spawn("feed", self.prefetcher.feed)
        for i in range(self.num_workers):
            self._spawn(f"collate{i}", self.prefetcher.work)
        for worker in self.workers:
            self._spawn(f"target{worker.index}", worker.run)
        drafter_threads = len(self.threads)
        for loop in self.loops:
            self._spawn(f"drafter{loop.replica}", loop.run)
        drafters = self.threads[drafter_threads:]
        stop_seen_at: float | None = None
        reported = False
        try:
            while any(t.is_alive() for t in drafters) and self._failure is None:
                if stop.is_set() and stop_signum is None:
                    stop_signum, stop_seen_at = stop.signum, time.perf_counter()
                    log.warning("stop requested: finishing the current step, then a checkpoint")
                    for loop in self.loops:
                        loop.stop_requested.set()
                elif (
                    stop_seen_at is not None
                    and not reported
                    and time.perf_counter() - stop_seen_at > self.stop_report_s
                ):
                    reported = True
                    log.warning(
                        "stop requested %.0f s ago and the step in hand has not ended "
                        "(pipeline.stop_report_s); where each pipeline thread is:\n%s",
                        time.perf_counter() - stop_seen_at,
                        thread_stacks([t for t in self.threads if t.is_alive()]),
                    )
                time.sleep(self.poll_interval_s)
                self._observe(stop)
        finally:
            if stop_signum is not None:
                # Let drafters finish the step they are in, then unblock whoever waits.
                for thread in drafters:
                    thread.join(self.shutdown_timeout_s)
            self._close_everything()
            self._join_all()
        if self._failure is not None:
            raise self._failure[1]
        return stop_signum

    def _final_position(self) -> DataPosition:
        steps = {loop.step for loop in self.loops}
        assert len(steps) == 1, f"drafter replicas stopped at different steps: {steps}"
        return self.tracker.position(steps.pop())
