"""scripts/check_fast_path.py: the fast path trained beside the reference on the run's own batches.

On CPU the fused LM-head loss is the fast part that runs (flex_attention has no CPU backward);
the check must find it equal to the reference, and must find a path that is not.
"""

from __future__ import annotations

import torch

from dflash.data.scheduler import held_out_ids
from dflash.step.step_paths import STEP_VARIANTS
from tests.scripts_as_modules import load_script


def test_the_fused_loss_matches_the_reference_and_a_different_step_does_not(tmp_path, data_cache):
    check = load_script("check_fast_path")
    overrides = [
        "data.num_samples=48",
        "data.val_samples=4",
        f"paths.output_dir={tmp_path}",
        f"paths.cache_dir={data_cache}",
    ]
    setup = check.Setup.load(overrides, steps=6, device=torch.device("cpu"))
    # The run's own batches: the held-out split is never trained on here either.
    held_out = set(held_out_ids(len(setup.dataset), 4, seed=0).tolist())
    assert held_out and not held_out & {i for plan in setup.plans for i in plan.sample_ids}
    variants = {
        "reference": STEP_VARIANTS["reference"],
        "fused": STEP_VARIANTS["fused"],
        # Not the same step: another loss weighting (other gradients) and a learning rate that
        # barely moves the weights (another curve); the check must tell both apart.
        "other": STEP_VARIANTS["fused"] + ["loss.gamma=1.0", "optimizer.lr=1e-5"],
    }
    grads = check.gradients_at_init(setup, variants)
    assert grads["reference"].worst == []
    assert max(error for _, error in grads["fused"].worst) < 1e-5
    assert abs(grads["fused"].loss - grads["reference"].loss) < 1e-5
    assert max(error for _, error in grads["other"].worst) > 1e-2

    curves = check.train_side_by_side(setup, variants, every=2)
    assert [p.step for p in curves["fused"]] == [2, 4, 6]
    for fused, reference in zip(curves["fused"], curves["reference"]):
        assert abs(fused.loss - reference.loss) < 1e-4 and abs(fused.grad_norm - reference.grad_norm) < 1e-3
    assert any(abs(o.loss - r.loss) > 1e-2 for o, r in zip(curves["other"], curves["reference"]))
