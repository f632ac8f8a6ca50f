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
import logging

import numpy as np
import torch

from dflash.data.collate import collate
from dflash.data.dataset import TokenDataset
from dflash.data.scheduler import BlockBudget, PlannedBatch, pack_bucket
from dflash.drafters.backbone import DFlashDrafter
from dflash.step.block_mask import tiles_by_window
from dflash.step.loss import VAL_FIGURES, objective_figures
from dflash.step.metrics import StepMetrics
from dflash.step.step import BlockSettings, drafter_forward_loss, make_blocks
from dflash.target.model import FrozenTarget
from dflash.target.target_head import TargetHead

log = logging.getLogger(__name__)


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
        # The training step's own accumulator: the same sums, read back once.
        variant = self.settings.variant
        sums = StepMetrics(block_size=drafter.block_size, num_buckets=1, device=device, variant=variant)
        no_grad_norm = torch.zeros((), device=device)
        for plan in self.batches:
            batch = collate(self.dataset, plan)
            blocks = make_blocks(batch, drafter, self.settings, keep_fraction=0.0)
            tiles = None
            if self.settings.flex_attention:
                tiles = {
                    window: table.to(device)
                    for window, table in tiles_by_window(
                        blocks, batch.input_ids.shape[1], drafter.windows
                    ).items()
                }
            stats = drafter_forward_loss(
                head,
                drafter,
                target.features(batch.input_ids.to(device)),
                blocks.to(device),
                logits_chunk=self.settings.loss.logits_chunk,
                tiles=tiles,
                variant=variant,
                block_loss=self.settings.loss,
            )
            sums.add(stats, no_grad_norm, batch, anchors=0)
        window = sums.publish(end_step=0, lr=0.0)
        if window.ready is not None:
            window.ready.synchronize()
        totals = window.sums()
        if totals["nonfinite_steps"]:
            # StepMetrics leaves a non-finite batch out of the sums rather than poisoning them.
            log.warning(
                "validation: %d held-out batch(es) gave a non-finite loss; left out of val/",
                totals["nonfinite_steps"],
            )
        figures = objective_figures(totals, variant)
        names = VAL_FIGURES + variant.figure_names
        return {f"val/{name}": figures[name] for name in names}
