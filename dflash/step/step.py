"""One drafter optimization step: blocks -> drafter forward/backward -> clip -> AdamW -> LR.

Nothing here reads a device value on the host; the step's sums go to `StepMetrics`
(dflash/step/metrics.py), which hands them to the host without a sync.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from dflash.data.collate import Batch
from dflash.drafters.backbone import DFlashDrafter
from dflash.step.block_mask import KvTiles, flex_block_mask, tiles_by_window
from dflash.step.blocks import DraftBlocks, build_blocks, layer_masks
from dflash.step.loss import BlockLoss, LossStats
from dflash.step.metrics import StepMetrics
from dflash.step.noise import NoiseSchedule
from dflash.step.variant import DFlashVariant
from dflash.target.target_head import TargetHead
from dflash.torch_runtime.compile import compiled_calls


@dataclass
class BlockSettings:
    seed: int
    num_anchors: int
    loss: BlockLoss  # position weights and the fused loss's chunking (config group `loss`)
    flex_attention: bool = False  # block-sparse flex_attention (else SDPA with the dense mask)
    compiled_loss: bool = False  # the fused loss's per-chunk work through torch.compile
    # What each block position predicts and how it is scored (config group `variant`).
    variant: DFlashVariant = field(default_factory=DFlashVariant)


def make_blocks(
    batch: Batch, drafter: DFlashDrafter, settings: BlockSettings, keep_fraction: float
) -> DraftBlocks:
    return build_blocks(
        batch.input_ids,
        batch.loss_mask,
        batch.lengths,
        batch.sample_ids,
        epoch=batch.plan.epoch,
        seed=settings.seed,
        block_size=drafter.block_size,
        num_anchors=settings.num_anchors,
        mask_token_id=drafter.mask_token_id,
        weights=settings.loss.position_weights(drafter.block_size, settings.variant.label_offset),
        keep_fraction=keep_fraction,
        label_offset=settings.variant.label_offset,
        with_prev_ids=settings.variant.needs_prev_ids,
    )


def split_final_state(features_BSF: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target's `features` with `final_state` on (dflash/target/model.py): the fused feature
    layers and, in its last `hidden_size` columns, the final hidden state (views, no copy)."""
    return features_BSF[..., :-hidden_size], features_BSF[..., -hidden_size:]


def drafter_forward_loss(
    head: TargetHead,
    drafter: DFlashDrafter,
    features_BSF: torch.Tensor,
    blocks: DraftBlocks,
    *,
    feature_noise_std: float = 0.0,
    noise_generator: torch.Generator | None = None,
    logits_chunk: int = 0,
    tiles: dict[int | None, KvTiles] | None = None,
    compiled_loss: bool = False,
    variant: DFlashVariant | None = None,
    block_loss: BlockLoss | None = None,
) -> LossStats:
    """tiles: the block-sparse tables of `blocks` per window of the drafter's layers
    (dflash.step.block_mask.tiles_by_window, on the drafter's device) for flex_attention; None: SDPA
    with the dense masks. variant (None: DFlash): the loss; one that `needs_final_state` reads
    the target's final hidden state from the last columns of `features_BSF`. block_loss: asked
    for the blocks' weights once the drafter's hidden states exist (`BlockLoss.weigh`)."""
    variant = variant or DFlashVariant()
    final_BSH = None
    if variant.needs_final_state:
        features_BSF, final_BSH = split_final_state(features_BSF, drafter.config.hidden_size)
    with torch.no_grad():
        block_emb = head.embed_tokens(blocks.block_ids)  # frozen: no gradient to the embeddings
    ctx_len = features_BSF.shape[1]
    if tiles is None:
        mask = layer_masks(blocks.anchors, blocks.anchor_valid, ctx_len, blocks.block_size, drafter.windows)
    else:
        mask = {
            window: flex_block_mask(
                tiles[window], blocks.anchors, blocks.anchor_valid, ctx_len, blocks.block_size, window
            )
            for window in drafter.windows
        }
    device_type = features_BSF.device.type
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device_type == "cuda" else nullcontext()
    with autocast:
        hidden = drafter(features_BSF, block_emb, blocks.positions, mask, feature_noise_std, noise_generator)
        if block_loss is not None:  # weights that follow the drafter's own predictions (loss=dpace)
            blocks = block_loss.weigh(hidden, head.lm_head, blocks)
        return variant_loss(
            variant,
            hidden,
            head=head,
            drafter=drafter,
            blocks=blocks,
            features_BSF=features_BSF,
            final_BSH=final_BSH,
            logits_chunk=logits_chunk,
            compiled=compiled_loss,
        )


def variant_loss(
    variant: DFlashVariant,
    hidden_BQH: torch.Tensor,
    *,
    head: TargetHead,
    drafter: DFlashDrafter,
    blocks: DraftBlocks,
    features_BSF: torch.Tensor,
    final_BSH: torch.Tensor | None,
    logits_chunk: int = 0,
    compiled: bool = False,
) -> LossStats:
    """The variant's loss on the drafter's hidden states at the block positions: `features_BSF`
    the fused feature layers (`split_final_state`'s first part when the variant
    `needs_final_state`, `final_BSH` its second, else None); the target's embeddings and those
    features go to a variant that `needs_context`."""
    context = (
        {"embed_tokens": head.embed_tokens, "features_BSF": features_BSF} if variant.needs_context else {}
    )
    return variant.block_loss(
        hidden_BQH,
        lm_head=head.lm_head,
        drafter=drafter,
        blocks=blocks,
        final_BSH=final_BSH,
        logits_chunk=logits_chunk,
        compiled=compiled,
        **context,
    )


class DrafterStep:
    """blocks -> drafter forward/backward -> clip -> AdamW -> LR schedule."""

    def __init__(
        self,
        *,
        head: TargetHead,
        drafter: DFlashDrafter,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        noise: NoiseSchedule,
        block_settings: BlockSettings,
        grad_clip: float,
        num_buckets: int,
    ):
        self.head, self.drafter = head, drafter  # head: the target's tables on the drafter's device
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.noise, self.block_settings, self.grad_clip = noise, block_settings, grad_clip
        self.device = next(drafter.parameters()).device
        self.noise_generator = torch.Generator(device=self.device)
        self.metrics = StepMetrics(
            drafter.block_size, num_buckets, self.device, variant=block_settings.variant
        )

    def forward_backward(self, batch: Batch, features_BSF: torch.Tensor, step: int) -> tuple[LossStats, int]:
        """Backward of the weighted-CE *numerator*; `apply` divides by the step's total weight.

        Dividing once by the weight summed over every replica is what keeps a replica that drew
        a short or empty batch from counting as much as one that drew a full batch.
        """
        settings = self.block_settings
        blocks = make_blocks(batch, self.drafter, settings, self.noise.keep_fraction(step))
        num_anchors = int(blocks.anchor_valid.sum())  # host tensor: no device sync
        tiles = None
        if settings.flex_attention:  # tile tables from the host-side anchors: no device sync
            tiles = {
                window: table.to(self.device, non_blocking=True)
                for window, table in tiles_by_window(
                    blocks, batch.input_ids.shape[1], self.drafter.windows
                ).items()
            }
        blocks = blocks.to(self.device, non_blocking=True)
        # Seeded by the batch's place in the schedule: resumed runs, any replica or node count
        # draw the same feature noise for the same batch, with no generator state to save.
        plan = batch.plan
        self.noise_generator.manual_seed((settings.seed << 40) ^ (plan.epoch << 24) ^ plan.index)
        stats = drafter_forward_loss(
            self.head,
            self.drafter,
            features_BSF.to(self.device, non_blocking=True),
            blocks,
            feature_noise_std=self.noise.feature_std(step),
            noise_generator=self.noise_generator,
            logits_chunk=settings.loss.logits_chunk,
            tiles=tiles,
            compiled_loss=settings.compiled_loss,
            variant=settings.variant,
            block_loss=settings.loss,
        )
        with compiled_calls():  # the first backward through a compiled graph compiles it
            stats.weighted_ce.backward()
        return stats, num_anchors

    def apply(self, total_weight: torch.Tensor) -> torch.Tensor:
        """grads /= total weight, clip, AdamW, LR schedule; returns the pre-clip grad norm.

        Non-finite guard without a host sync: when the gradient norm is NaN or inf (a NaN loss
        gives one), the fused AdamW kernel skips the whole update (weights, moments, step
        count) through its `found_inf` input, the same mechanism AMP's GradScaler uses. The
        weights never hold a NaN, so every checkpoint stays good; the metrics count the skip.
        """
        scale = 1.0 / total_weight.clamp_min(1e-6)
        grads = [p.grad for p in self.drafter.parameters() if p.grad is not None]
        # No pass over the gradients to rescale them (a 1B-parameter drafter's fp32 gradients
        # are 4 GB): the norm of the scaled gradients is scale x the raw norm; the clip
        # coefficient is clip_grad_norm_'s, min(1, max_norm / (norm + 1e-6)); and the fused
        # AdamW kernel divides each gradient by its `grad_scale` input as it reads it (AMP's
        # GradScaler unscales through the same input), so the loss-weight normalisation and the
        # clip ride on the update itself (H200, 1.05B parameters: a 2.3 ms scaling pass
        # replaced by 1.5 ms more in the AdamW kernel, which writes the unscaled gradients).
        grad_norm = torch.nn.utils.get_total_norm(grads) * scale
        clip = (self.grad_clip / (grad_norm + 1e-6)).clamp(max=1.0)
        self.optimizer.grad_scale = (1.0 / (clip * scale)).to(torch.float32)
        self.optimizer.found_inf = (~torch.isfinite(grad_norm)).to(torch.float32)
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale, self.optimizer.found_inf
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def __call__(
        self,
        batch: Batch,
        features_BSF: torch.Tensor,
        step: int,
        *,
        reduce_gradients: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    ) -> int:
        """One training step; returns the number of anchors. Both pipelines call it.

        reduce_gradients(drafter, weight): with replicas, sums every replica's gradients into
        this one's and returns the summed loss weight (the asynchronous pipeline's
        `ReplicaGradSync`); None for a single replica, whose own weight is the total."""
        stats, num_anchors = self.forward_backward(batch, features_BSF, step)
        total_weight = (
            stats.weight if reduce_gradients is None else reduce_gradients(self.drafter, stats.weight)
        )
        grad_norm = self.apply(total_weight)
        self.metrics.add(stats, grad_norm, batch, num_anchors)
        return num_anchors

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
