#!/usr/bin/env python
"""Does the fast training path learn what the reference path learns? Side by side, in one run.

    python scripts/check_fast_path.py [--steps 150] [--every 10] [--variants reference,fused,flex,compiled]
        [hydra overrides: the run's own config, e.g. experiment=smollm2_b16 data.files=[regen.jsonl]]

Use it on a new target before a long run: the fast path's parts (block-sparse flex attention,
the fused LM-head loss, compiled layers) are tested against the reference on small random
models, and this runs that comparison on *your* target, data and shapes.

1. Gradients at the initial weights, on the first batch the run would train on: per variant the
   loss and, per parameter tensor, |g - g_ref| / |g_ref| against the `reference` variant (the
   worst three named). Under bf16 autocast expect ~1e-2; a broken path shows O(1).
2. Training: every variant from the same initial weights on the same batches (the run's own
   planner, epoch 0 order) by the step object a run calls; loss, pre-clip gradient norm and
   position-1 accuracy of each --every-step window, side by side (as a run logs them).

Variants: dflash/step/step_paths.py (`reference`, then `fused`, `flex`, `compiled`, each adding one
fast part; `compiled` is the CUDA default). flex_attention has no CPU backward: on CPU compare
`reference,fused`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.data.collate import collate  # noqa: E402
from dflash.data.dataset import TokenDataset  # noqa: E402
from dflash.run.inputs import load_training_data, script_target  # noqa: E402
from dflash.run.launch import plan_batches, step_fn_for  # noqa: E402
from dflash.step.build import build_drafter, build_variant, compile_drafter, uses_compile  # noqa: E402
from dflash.step.loss import objective_figures  # noqa: E402
from dflash.step.step_paths import STEP_VARIANTS  # noqa: E402
from dflash.target.model import FrozenTarget  # noqa: E402
from dflash.target.target_head import TargetHead  # noqa: E402
from dflash.tools.compose import compose_typed  # noqa: E402


@dataclass
class Setup:
    """What every variant shares: the composed overrides, the frozen target, the data and the
    batches the run would train on (its own planner, epoch 0 order)."""

    base: list[str]
    target: FrozenTarget
    head: TargetHead
    layer_ids: list[int]
    dataset: TokenDataset
    plans: list

    @classmethod
    def load(cls, overrides: list[str], steps: int, device: torch.device) -> Setup:
        base = (["gpu=single"] if device.type == "cuda" else ["gpu=cpu"]) + overrides
        cfg = compose_typed(base)
        target, layer_ids = script_target(
            cfg, device, "check_fast_path"
        )  # a GGUF target.path: converted once
        dataset, _ = load_training_data(cfg, target)
        planner, _ = plan_batches(cfg, dataset)  # the run's own plan, held-out split left out
        plans = [planner.at(i) for i in range(steps)]
        return cls(base, target, TargetHead.of(target), layer_ids, dataset, plans)

    def step_fn(self, extra: list[str]):
        """A fresh drafter (the config's init seed: every variant starts from the same weights)
        and its optimizer, under the variant's overrides."""
        cfg = compose_typed(self.base + extra)
        device = self.target.device
        drafter = build_drafter(
            cfg.drafter, self.target.config, self.layer_ids, str(device), build_variant(cfg.variant)
        )
        if uses_compile(cfg.drafter.compile, device):
            compile_drafter(drafter, cfg.drafter)
        return step_fn_for(
            cfg,
            head=self.head,
            drafter=drafter,
            total_steps=len(self.plans),
            num_buckets=len(cfg.data.bucket_edges),
        )

    def batch(self, index: int):
        batch = collate(self.dataset, self.plans[index])
        with torch.no_grad():
            return batch, self.target.features(batch.input_ids.to(self.target.device))


@dataclass
class GradientCheck:
    loss: float
    grad_norm: float
    worst: list[tuple[str, float]]  # (parameter, |g - g_ref| / |g_ref|), largest first; [] for the reference


def gradients_at_init(setup: Setup, variants: dict[str, list[str]]) -> dict[str, GradientCheck]:
    """Each variant's loss and gradients on the first batch, against the first variant's."""
    batch, features = setup.batch(0)
    reference: dict[str, torch.Tensor] | None = None
    checks = {}
    for variant, extra in variants.items():
        step_fn = setup.step_fn(extra)
        stats, _ = step_fn.forward_backward(batch, features, 0)
        grads = {
            name: (p.grad.float() / stats.weight).clone()
            for name, p in step_fn.drafter.named_parameters()
            if p.grad is not None
        }
        norm = torch.sqrt(sum(g.square().sum() for g in grads.values())).item()
        worst = []
        if reference is None:
            reference = grads
        else:
            errors = {
                name: ((g - reference[name]).norm() / reference[name].norm().clamp_min(1e-30)).item()
                for name, g in grads.items()
            }
            worst = sorted(errors.items(), key=lambda kv: -kv[1])[:3]
        checks[variant] = GradientCheck(stats.loss().item(), norm, worst)
    return checks


@dataclass
class CurvePoint:
    """The last `every` steps, as a training run logs them (one metric window)."""

    step: int
    loss: float
    grad_norm: float  # before clipping, mean over the window's steps
    acc_position_1: float


def train_side_by_side(
    setup: Setup, variants: dict[str, list[str]], every: int
) -> dict[str, list[CurvePoint]]:
    """Every variant trained on the same batches from the same weights, by the step object a run
    calls; a point (that window's figures) every `every` steps."""
    curves = {}
    for variant, extra in variants.items():
        step_fn = setup.step_fn(extra)
        curve = []
        for step in range(len(setup.plans)):
            batch, features = setup.batch(step)
            step_fn(batch, features, step)
            if (step + 1) % every == 0:
                window = step_fn.metrics.publish(step + 1, step_fn.lr)
                if window.ready is not None:
                    window.ready.synchronize()
                sums = window.sums()
                figures = objective_figures(sums)
                grad_norm = sums["grad_norm"] / window.steps
                curve.append(CurvePoint(step + 1, figures["loss"], grad_norm, figures["acc_pos_1"]))
        curves[variant] = curve
    return curves


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--variants", default="reference,fused,flex,compiled")
    args, overrides = parser.parse_known_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup = Setup.load(overrides, args.steps, device)
    variants = {name: STEP_VARIANTS[name] for name in args.variants.split(",") if name}
    first = setup.plans[0]
    print(
        f"{device}; overrides: {' '.join(setup.base)}; {len(setup.dataset)} samples; {args.steps} steps; "
        f"first batch: {len(first.sample_ids)} samples",
        flush=True,
    )
    print("\nat the initial weights, first batch (gradient errors against the first variant):")
    for variant, check in gradients_at_init(setup, variants).items():
        worst = ", ".join(f"{name} {error:.2e}" for name, error in check.worst)
        print(f"{variant:>13}: loss {check.loss:.5f}  |grad| {check.grad_norm:.4g}  {worst}", flush=True)
    curves = train_side_by_side(setup, variants, args.every)
    print("\n| step | " + " | ".join(f"{v}: loss, grad norm, acc@1" for v in variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for points in zip(*curves.values()):
        cells = [f"{p.loss:.3f}, {p.grad_norm:.3g}, {p.acc_position_1:.3f}" for p in points]
        print(f"| {points[0].step} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
