"""`dflash schedule`: what each batch order does to bucket runs, before any GPU time is spent.

    dflash schedule data=conversations data.files=[chat.jsonl] target=hf target.path=/models/MyModel
    dflash schedule --window 16 --epoch 1 data.num_samples=4096

The overrides are a training run's (the data, target and bucket edges it uses).

For the configured data and bucket edges, prints for `shuffle` and `interleave`: each bucket's
share of batches, the distribution of same-bucket run lengths (runs of consecutive long batches
made the "fluffy", trimodal loss), and the bucket entropy in sliding windows (1 = every window
mixes all buckets evenly).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np

from dflash.tools.arguments import command_parser, composed_or_refused, flags_and_overrides


def run_lengths(buckets: list[int]) -> Counter:
    return Counter(len(list(group)) for _, group in itertools.groupby(buckets))


def windowed_entropy(buckets: list[int], num_buckets: int, window: int) -> tuple[float, float]:
    """Mean and minimum normalized entropy of the bucket mix over sliding windows."""
    values = []
    for start in range(0, max(1, len(buckets) - window + 1)):
        counts = np.bincount(buckets[start : start + window], minlength=num_buckets)
        p = counts[counts > 0] / counts.sum()
        values.append(abs(float(-(p * np.log(p)).sum() / math.log(max(2, num_buckets)))))
    return float(np.mean(values)), float(np.min(values))


def report(orders: dict[str, list[int]], num_buckets: int, window: int) -> str:
    lines = []
    for name, buckets in orders.items():
        share = np.bincount(buckets, minlength=num_buckets) / len(buckets)
        runs = run_lengths(buckets)
        mean_h, min_h = windowed_entropy(buckets, num_buckets, window)
        lines.append(f"== scheduler={name}: {len(buckets)} batches")
        lines.append("  bucket share      " + "  ".join(f"b{i}={100 * s:.1f}%" for i, s in enumerate(share)))
        lines.append(
            "  same-bucket runs  "
            + "  ".join(f"{k}:{runs[k]}" for k in sorted(runs))
            + f"   (longest {max(runs)})"
        )
        lines.append(f"  entropy/{window:<3}      mean {mean_h:.3f}  min {min_h:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("schedule", __doc__, usage="%(prog)s [--window N] [--epoch N] [OVERRIDE ...]")
    parser.add_argument("--window", type=int, default=8, help="batches per entropy window")
    parser.add_argument("--epoch", type=int, default=0)
    args, overrides = flags_and_overrides(parser, argv)

    from dflash.config.schema import InterleaveSchedulerConfig, ShuffleSchedulerConfig
    from dflash.data.scheduler import build_planner
    from dflash.run.inputs import load_training_data

    cfg = composed_or_refused("schedule", overrides)
    dataset, _ = load_training_data(cfg)
    # The two built-in orders over the run's buckets and budgets, and the run's own if it is another.
    nodes = {"shuffle": ShuffleSchedulerConfig(), "interleave": InterleaveSchedulerConfig()}
    if cfg.scheduler._target_ not in {node._target_ for node in nodes.values()}:
        nodes[cfg.scheduler._target_] = cfg.scheduler
    orders = {}
    for name, node in nodes.items():
        planner = build_planner(
            node,
            data=cfg.data,
            lengths=dataset.lengths,
            seed=cfg.seed,
            num_anchors=cfg.drafter.num_anchors,
            block_size=cfg.drafter.block_size,
        )
        orders[name] = [b.bucket for b in planner.epoch(args.epoch)]
    edges = list(cfg.data.bucket_edges)
    print(
        f"{len(dataset)} samples; buckets (upper edges) {edges}; {cfg.data.tokens_per_batch} tokens per batch"
    )
    print(report(orders, len(edges), args.window))


if __name__ == "__main__":
    main()
