"""How busy each device role was, and the target/drafter split that would balance them.

Every batch passes through one target forward and one drafter step, so with T target GPUs and
D drafter GPUs the pipeline moves at most min(T / t_target, D / t_drafter) batches per second,
where t_* is a role's device time per batch. For a node of N GPUs the best split is the T that
maximises that minimum. The times come from CUDA events around each role's work on its stream
(CPU runs: the host time of the work), measured in the run itself, so the advice follows the
model sizes, the sequence lengths and the anchors actually used. Stream time includes the gaps
where the GPU waits for the host to launch the next kernel: for small, launch-bound models it is
the host's pace, which is what bounds that role's throughput.

When both roles share a GPU (gpu=single) their kernels overlap and each one's time includes
waiting for the other's; the advice is then an estimate, and a gpu=split run measures clean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # this module stays light: dflash-report formats summaries with it
    from dflash.pipeline.counters import WorkCounters


@dataclass(frozen=True)
class RoleTimes:
    target_s_per_batch: float  # device time of one target forward
    drafter_s_per_batch: float  # device time of one drafter step (forward, backward, sync, AdamW)

    def batches_per_s(self, num_targets: int, num_drafters: int) -> float:
        return min(num_targets / self.target_s_per_batch, num_drafters / self.drafter_s_per_batch)

    def best_num_targets(self, num_gpus: int) -> int:
        """The gpu.target of `gpu=split` for a node of `num_gpus` (>= 2) GPUs; on a tie, the
        split with more drafters (they also hold optimizer state and gain from more replicas)."""
        if num_gpus < 2:
            raise ValueError("a split needs at least 2 GPUs (one per role); use gpu=single")
        return max(range(1, num_gpus), key=lambda t: (self.batches_per_s(t, num_gpus - t), -t))

    def advice(self, num_gpus: int) -> str:
        """One line: the split for `num_gpus` and what it should reach against the one-GPU pace."""
        targets = self.best_num_targets(num_gpus)
        rate = self.batches_per_s(targets, num_gpus - targets)
        one_gpu = 1.0 / (self.target_s_per_batch + self.drafter_s_per_batch)
        return (
            f"{num_gpus} GPUs: gpu=split gpu.target={targets} ({targets} target + "
            f"{num_gpus - targets} drafter, ~{rate / one_gpu:.1f}x one GPU doing both)"
        )


def advice_node_sizes(visible: int) -> list[int]:
    """The node sizes to advise for: this node's, and 8 (the usual training node) if different."""
    return sorted({n for n in (visible, 8) if n >= 2})


def role_summary(
    *, targets: list[WorkCounters], drafters: list[WorkCounters], wall_s: float
) -> dict[str, float]:
    """`roles/` figures of a whole run: device time per batch, each role's busy share of the
    training wall time (device time over the role's devices), and the drafters' data wait. The
    run summary prefers the steady window's (`Trainer.role_summary`)."""
    totals: dict[str, float] = {}
    for counters in (*targets, *drafters):
        totals.update(counters.stats())
    return window_role_summary({}, totals, wall_s)


def window_role_summary(
    before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, float]:
    """The `roles/` figures between two `pipeline_stats()` snapshots taken `seconds` apart (or
    from the start, `before` empty): what the run summary reports, over the same steady window
    as its throughput. Whole-run totals include the first steps, whose device spans also hold the
    host's compilation of the step (a 40-step run at the paper shape: ~75 s of drafter compile
    in the first span), and would double a short run's per-batch times and skew the split
    advice."""
    summary: dict[str, float] = {}
    if seconds <= 0:
        return summary
    names = sorted(
        k.removeprefix("count/").removesuffix("_timed_batches") for k in after if k.endswith("_timed_batches")
    )

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    for role in ("target", "drafter"):
        workers = [n for n in names if n.startswith(role)]
        spans = [(delta(f"worker/{n}_compute_total_s"), delta(f"count/{n}_timed_batches")) for n in workers]
        per_batch = [device_s / batches for device_s, batches in spans if batches > 0]
        if not per_batch:
            return {}  # a role finished no step in the window: nothing steady to report
        summary[f"roles/{role}_s_per_batch"] = sum(per_batch) / len(per_batch)
        summary[f"roles/{role}_busy_frac"] = min(sum(s for s, _ in spans) / (len(workers) * seconds), 1.0)
        if role == "drafter":
            waited = sum(delta(f"worker/{n}_wait_total_s") for n in workers)
            summary["roles/data_wait_frac"] = min(waited / (len(workers) * seconds), 1.0)
    return summary


def role_times(summary: dict[str, float]) -> RoleTimes | None:
    if "roles/target_s_per_batch" not in summary or "roles/drafter_s_per_batch" not in summary:
        return None
    return RoleTimes(summary["roles/target_s_per_batch"], summary["roles/drafter_s_per_batch"])


def role_lines(summary: dict[str, Any]) -> list[str]:
    """How busy each role was and, on GPUs, the split that would balance them (for this node's
    GPU count and for an 8-GPU node)."""
    if "roles/target_busy_frac" not in summary:
        return []
    lines = []
    if summary["replicas"] > 1:
        lines.append(
            f"replicas          {summary['replicas']}, identical (weights digest {summary['replica_digest']})"
        )
    lines += [
        f"roles busy        target {summary['roles/target_busy_frac']:.0%}, drafter "
        f"{summary['roles/drafter_busy_frac']:.0%}, drafters waiting for data {summary['roles/data_wait_frac']:.0%}"
    ]
    times = role_times(summary)
    if times is None:
        return lines
    lines.append(
        f"per batch         target {times.target_s_per_batch * 1e3:.1f} ms, drafter "
        f"{times.drafter_s_per_batch * 1e3:.1f} ms ({'CUDA-event' if summary['node_gpus'] else 'CPU'} time)"
    )
    if summary["node_gpus"] >= 1:
        for size in advice_node_sizes(summary["node_gpus"]):
            lines.append(f"split advice      {times.advice(size)}")
        faster = summary.get("target_faster_settings")
        if faster and times.target_s_per_batch > times.drafter_s_per_batch:
            # The advice follows the target path this run measured; a faster one needs fewer GPUs.
            lines.append(
                f"faster target     the target is the slower role and ran without {' '.join(faster)} "
                "(docs/configuration.md): with them it needs fewer of the split's GPUs"
            )
    return lines
