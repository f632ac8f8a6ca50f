"""One drafter optimization step and its on-device metric accumulation.

Nothing here reads a device value on the host: loss, accuracy counts and grad norm stay device
tensors in `StepMetrics` until whoever logs calls `snapshot()`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from dflash.blocks import DraftBlocks, block_attention_mask, build_blocks
from dflash.data.collate import Batch
from dflash.loss import LossStats, draft_loss, tau_from_accuracy
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import FrozenTarget
from dflash.noise import NoiseSchedule


@dataclass
class BlockSettings:
    seed: int
    num_anchors: int
    gamma: float


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
        gamma=settings.gamma,
        keep_fraction=keep_fraction,
    )


def drafter_forward_loss(
    target: FrozenTarget,
    drafter: DFlashDrafter,
    features_BSF: torch.Tensor,
    blocks: DraftBlocks,
    feature_noise_std: float,
    noise_generator: torch.Generator | None,
) -> LossStats:
    with torch.no_grad():
        block_emb = target.embed_tokens(blocks.block_ids)  # frozen: no gradient to the embeddings
    mask = block_attention_mask(blocks.anchors, blocks.anchor_valid, features_BSF.shape[1], blocks.block_size)
    device_type = features_BSF.device.type
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device_type == "cuda" else nullcontext()
    with autocast:
        hidden = drafter(features_BSF, block_emb, blocks.positions, mask, feature_noise_std, noise_generator)
        return draft_loss(hidden, target.lm_head, blocks)


@dataclass
class StepMetrics:
    """Running sums over a log window, on the drafter's device."""

    block_size: int
    device: torch.device
    weighted_ce: torch.Tensor = field(init=False)
    weight: torch.Tensor = field(init=False)
    correct: torch.Tensor = field(init=False)
    counted: torch.Tensor = field(init=False)
    grad_norm_sum: torch.Tensor = field(init=False)
    steps: int = 0
    real_tokens: int = 0
    anchors: int = 0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        zeros = lambda *shape: torch.zeros(shape, device=self.device)  # noqa: E731
        self.weighted_ce, self.weight, self.grad_norm_sum = zeros(), zeros(), zeros()
        self.correct, self.counted = zeros(self.block_size), zeros(self.block_size)
        self.steps = self.real_tokens = self.anchors = 0

    def add(self, stats: LossStats, grad_norm: torch.Tensor, real_tokens: int, anchors: int) -> None:
        self.weighted_ce += stats.weighted_ce.detach()
        self.weight += stats.weight
        self.correct += stats.correct
        self.counted += stats.counted
        self.grad_norm_sum += grad_norm.detach()
        self.steps += 1
        self.real_tokens += real_tokens
        self.anchors += anchors

    def snapshot(self) -> dict[str, float]:
        """Host floats for the window (the one place that reads device values)."""
        weighted_ce, weight, grad_norm = (
            t.item() for t in (self.weighted_ce, self.weight, self.grad_norm_sum)
        )
        correct, counted = self.correct.tolist(), self.counted.tolist()
        acc = [c / n if n > 0 else float("nan") for c, n in zip(correct, counted)]
        metrics = {
            "train/loss": weighted_ce / weight if weight > 0 else 0.0,
            "train/acc": sum(correct[1:]) / max(1.0, sum(counted[1:])),
            "train/tau_sim": tau_from_accuracy(acc),
            "train/grad_norm": grad_norm / max(1, self.steps),
            "train/anchors_per_step": self.anchors / max(1, self.steps),
        }
        metrics.update({f"train/acc_pos_{k}": acc[k] for k in range(1, self.block_size)})
        return metrics


class DrafterStep:
    """blocks -> drafter forward/backward -> clip -> AdamW -> LR schedule."""

    def __init__(
        self,
        target: FrozenTarget,
        drafter: DFlashDrafter,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        noise: NoiseSchedule,
        block_settings: BlockSettings,
        grad_clip: float,
    ):
        self.target, self.drafter = target, drafter
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.noise, self.block_settings, self.grad_clip = noise, block_settings, grad_clip
        self.device = next(drafter.parameters()).device
        self.noise_generator = torch.Generator(device=self.device)
        self.metrics = StepMetrics(drafter.block_size, self.device)

    def __call__(self, batch: Batch, features_BSF: torch.Tensor, step: int) -> None:
        blocks = make_blocks(batch, self.drafter, self.block_settings, self.noise.keep_fraction(step))
        num_anchors = int(blocks.anchor_valid.sum())  # host tensor: no device sync
        blocks = blocks.to(self.device, non_blocking=True)
        feature_std = self.noise.feature_std(step)
        # Seeded by step: resumed runs draw the same feature noise without saving generator state.
        self.noise_generator.manual_seed(self.block_settings.seed * 1_000_003 + step)
        stats = drafter_forward_loss(
            self.target, self.drafter, features_BSF.to(self.device), blocks, feature_std, self.noise_generator
        )
        stats.loss().backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.metrics.add(stats, grad_norm, batch.real_tokens, num_anchors)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
