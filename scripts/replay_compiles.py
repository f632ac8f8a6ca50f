#!/usr/bin/env python
"""Which batches of a run's plan make torch.compile build new graphs mid-run, and why.

    python scripts/replay_compiles.py --dataset CACHE.safetensors [--batches 0:0,0:1617,2:1625]
        [hydra overrides: the run's own config, e.g. experiment=smollm2_b16 target=...]

A graph compiled mid-run stops the whole pipeline: every thread that calls compiled code waits
for the compile (dflash/torch_runtime/compile.py). A SmolLM2 run on an H200 stood still ~50-90 s at a
time at a few batches of its schedule. This replays chosen batches of the run's own plan
(`dflash-prep`'s cache file, the run's planner) through the compiled target and drafter step, in
order, and prints per batch its shape, the graphs each role compiled and the wall time; torch's
own log (`recompiles`) names the guard that failed. Default batches: epoch 0's first, then every
epoch's batches with the fewest samples (where shapes are most unusual). The drafter's weights
change as in training (optimizer steps): shapes, not values, matter here.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.config.schema import Config  # noqa: E402
from dflash.data.collate import collate  # noqa: E402
from dflash.data.dataset import TokenDataset  # noqa: E402
from dflash.data.scheduler import BatchPlanner, PlannedBatch  # noqa: E402
from dflash.run.inputs import script_target  # noqa: E402
from dflash.run.launch import plan_batches, step_fn_for  # noqa: E402
from dflash.step.build import build_drafter, build_variant, compile_drafter  # noqa: E402
from dflash.target.target_head import TargetHead  # noqa: E402
from dflash.tools.compose import compose_typed  # noqa: E402
from dflash.torch_runtime.compile import CompileCounter  # noqa: E402


@dataclass
class Replayed:
    """One replayed batch: its place in the plan, its collated shape, the graphs each role
    compiled for it and the wall time of its target forward and drafter step."""

    plan: PlannedBatch
    samples: int
    length: int
    new_graphs: dict[str, int]
    seconds: float


def unusual_batches(planner: BatchPlanner, epochs: int) -> list[PlannedBatch]:
    """Epoch 0's first batch, then per epoch the batches with the fewest samples."""
    chosen = [planner.epoch(0)[0]]
    for epoch in range(epochs):
        plans = planner.epoch(epoch)
        fewest = min(len(p.sample_ids) for p in plans)
        chosen += [p for p in plans if len(p.sample_ids) == fewest and p not in chosen]
    return chosen


def parse_batches(planner: BatchPlanner, spec: str) -> list[PlannedBatch]:
    """'epoch:index,...' -> the planned batches."""
    out = []
    for item in spec.split(","):
        try:
            epoch, index = (int(x) for x in item.split(":"))
        except ValueError:
            raise SystemExit(f"--batches: {item!r} is not EPOCH:INDEX (e.g. 0:1617)") from None
        plans = planner.epoch(epoch)
        if not 0 <= index < len(plans):
            raise SystemExit(f"--batches: epoch {epoch} has {len(plans)} batches; {item!r} is not one")
        out.append(plans[index])
    return out


def replay(
    cfg: Config,
    *,
    dataset: TokenDataset,
    planner: BatchPlanner,
    batches: list[PlannedBatch],
    device: torch.device,
    backend: Callable[..., Any] | None = None,
) -> Iterator[Replayed]:
    """Build the run's target and drafter, compile both as a run does (`backend`: None for
    inductor), warm the target up as a run starts, then train on `batches` in order, yielding
    each as it finishes."""
    target, layer_ids = script_target(cfg, device, "replay_compiles")
    counters = {
        "target": CompileCounter("target features", backend),
        "drafter": CompileCounter("drafter", backend),
    }
    target.compile_features(
        counters["target"], dynamic=cfg.target.compile_dynamic, scope=cfg.target.compile_scope.value
    )
    drafter = build_drafter(cfg.drafter, target.config, layer_ids, str(device), build_variant(cfg.variant))
    compile_drafter(drafter, cfg.drafter, counters["drafter"])
    step_fn = step_fn_for(
        cfg,
        head=TargetHead.of(target),
        drafter=drafter,
        total_steps=len(batches),
        num_buckets=planner.num_buckets,
    )
    # As a run starts: the target warmed up on each bucket's largest batch (AsyncTrainer._warm_up).
    for batch_size, seq_len in planner.largest_batch_shapes(0):
        with torch.no_grad():
            target.features(torch.zeros((batch_size, seq_len), dtype=torch.int64, device=device))
    for step, plan in enumerate(batches):
        before = {role: c.graphs for role, c in counters.items()}
        started = time.perf_counter()
        batch = collate(dataset, plan)
        with torch.no_grad():
            features = target.features(batch.input_ids.to(device))
        step_fn(batch, features, step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield Replayed(
            plan=plan,
            samples=len(plan.sample_ids),
            length=int(batch.input_ids.shape[1]),
            new_graphs={role: c.graphs - before[role] for role, c in counters.items()},
            seconds=time.perf_counter() - started,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", type=Path, required=True, help="a dflash-prep cache (.safetensors)")
    parser.add_argument("--batches", default=None, help="epoch:index,... (default: see above)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs the default batches come from")
    args, overrides = parser.parse_known_args()
    torch._logging.set_logs(recompiles=True)  # torch names the failed guard of every recompile

    cfg = compose_typed(["gpu=single"] + overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = TokenDataset.load(args.dataset)
    planner, _ = plan_batches(cfg, dataset)
    batches = parse_batches(planner, args.batches) if args.batches else unusual_batches(planner, args.epochs)
    print("| batch | samples x length | target graphs | drafter graphs | seconds |")
    print("|---|---|---|---|---|")
    for row in replay(cfg, dataset=dataset, planner=planner, batches=batches, device=device):
        print(
            f"| {row.plan.epoch}:{row.plan.index} (bucket {row.plan.bucket}) | {row.samples} x {row.length} "
            f"| +{row.new_graphs['target']} | +{row.new_graphs['drafter']} | {row.seconds:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
