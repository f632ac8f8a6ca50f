"""Held-out samples (`data.val_samples`): the training objective on data training never sees.

`train/tau_sim` is measured on the batches being trained on, so a drafter that memorises its
data shows a tau_sim far above what decoding new prompts achieves. The validation split is a
fixed, seeded set of samples the batch planner leaves out; `val/loss`, `val/acc` and
`val/tau_sim` are computed on it exactly as training computes its own (same blocks, anchors
drawn for epoch 0 so every measurement sees the same blocks, no noise), at each periodic
evaluation and at the end of the run. `val/tau_block` is 1 + the mean leading run of correct
predictions per block (`loss.block_acceptance`): what greedy verification would accept on these
contexts, where tau_sim multiplies per-position accuracies as if they were independent.
`val/tau_decode` weighs those blocks as a decoder meets them (`loss.tau_from_rounds`): the
figure to set beside the tau that decoding held-out prompts measures.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from dflash.block_mask import tiles_for
from dflash.data.collate import collate
from dflash.data.dataset import TokenDataset
from dflash.data.schedule import BlockBudget, PlannedBatch, pack_bucket
from dflash.loss import tau_from_accuracy, tau_from_rounds, tau_from_runs
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import FrozenTarget
from dflash.models.target_head import TargetHead
from dflash.step import BlockSettings, drafter_forward_loss, make_blocks


def held_out_ids(num_samples: int, count: int, seed: int) -> np.ndarray:
    """`count` sample ids chosen by `seed` alone (sorted): the same split on every run of the
    same data, whatever the scheduler or replica count."""
    if not 0 <= count < num_samples:
        raise ValueError(
            f"data.val_samples={count} must be >= 0 and leave samples to train on ({num_samples} in the data)"
        )
    return np.sort(np.random.default_rng([seed, 0x7A1]).choice(num_samples, size=count, replace=False))


class Validation:
    def __init__(
        self,
        dataset: TokenDataset,
        sample_ids: np.ndarray,
        *,
        settings: BlockSettings,
        tokens_per_batch: int,
        block_budget: BlockBudget | None,
    ):
        self.dataset, self.settings = dataset, settings
        by_length = sample_ids[np.argsort(dataset.lengths[sample_ids], kind="stable")]  # little padding
        self.batches = [
            PlannedBatch(epoch=0, index=i, bucket=0, sample_ids=tuple(ids))
            for i, ids in enumerate(pack_bucket(by_length, dataset.lengths, tokens_per_batch, block_budget))
        ]
        self.num_samples = len(sample_ids)

    @torch.no_grad()
    def run(self, target: FrozenTarget, drafter: DFlashDrafter) -> dict[str, float]:
        """val/ metrics of `drafter`, run eagerly on the target's device (a copy when it lives
        elsewhere); reads the sums back once, at the end."""
        device = target.device
        if next(drafter.parameters()).device != device:
            drafter = copy.deepcopy(drafter).to(device)
        head = TargetHead.of(target)
        block_size = drafter.block_size
        # weighted CE, weight, accepted, blocks, rounds, correct [block_size], counted [block_size]
        sums = torch.zeros(5 + 2 * block_size, device=device)
        for plan in self.batches:
            batch = collate(self.dataset, plan)
            blocks = make_blocks(batch, drafter, self.settings, keep_fraction=0.0)
            tiles = None
            if self.settings.flex_attention:
                tiles = tiles_for(blocks, batch.input_ids.shape[1]).to(device)
            stats = drafter_forward_loss(
                head,
                drafter,
                target.features(batch.input_ids.to(device)),
                blocks.to(device),
                logits_chunk=self.settings.logits_chunk,
                tiles=tiles,
            )
            scalars = torch.stack(
                [stats.weighted_ce, stats.weight, stats.accepted, stats.blocks, stats.rounds]
            )
            sums += torch.cat([scalars, stats.correct, stats.counted])
        weighted_ce, weight, accepted, blocks, rounds, *rest = sums.tolist()
        correct, counted = rest[:block_size], rest[block_size:]
        acc = [c / n if n > 0 else float("nan") for c, n in zip(correct, counted)]
        return {
            "val/loss": weighted_ce / weight if weight > 0 else 0.0,
            "val/acc": sum(correct[1:]) / max(1.0, sum(counted[1:])),
            "val/tau_sim": tau_from_accuracy(acc),
            "val/tau_block": tau_from_runs(accepted, blocks),
            "val/tau_decode": tau_from_rounds(blocks, rounds),
        }
