"""Anchors, draft blocks, labels, loss weights and the training attention mask (docs/ARCHITECTURE.md §1).

Everything here that draws random numbers runs on the host, from a generator seeded by
(seed, epoch, sample id): the draw for a sample never depends on which batch it landed in,
and a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def host_to_device(tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """Page-locked staging makes a host->device copy truly asynchronous on CUDA."""
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=non_blocking)


def position_weights(block_size: int, gamma: float, label_offset: int = 0) -> torch.Tensor:
    """The weight of block position k, which predicts the j-th token after the anchor,
    j = k + label_offset: exp(-(j - 1) / gamma), 0 where j < 1. DFlash (offset 0): w_0 = 0 (the
    anchor is given), w_k = exp(-(k-1)/gamma); DSpark (offset 1): w_k = exp(-k/gamma)."""
    j = torch.arange(block_size, dtype=torch.float32) + label_offset
    weights = torch.exp(-(j - 1) / gamma)
    weights[j < 1] = 0.0
    return weights


def valid_anchor_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions p with loss_mask[p] and loss_mask[p + 1]: the anchor and its first target are supervised."""
    supervised = loss_mask.astype(bool)
    return np.flatnonzero(supervised[:-1] & supervised[1:])


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, sample_id])


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Up to num_anchors distinct valid positions, sorted; empty when the sample has none."""
    candidates = valid_anchor_positions(loss_mask)
    if len(candidates) <= num_anchors:
        return candidates
    return np.sort(rng.choice(candidates, size=num_anchors, replace=False))


@dataclass
class DraftBlocks:
    """One batch of draft blocks; Q = num_blocks * block_size query positions per sample."""

    block_ids: torch.Tensor  # [B, Q] anchor token, then MASK (or the true token under mask_ramp)
    positions: torch.Tensor  # [B, Q] a + k
    labels: torch.Tensor  # [B, Q] ids[a + k] (0 where invalid)
    weights: torch.Tensor  # [B, Q] loss weight: w_k where a label is supervised, else 0
    valid: torch.Tensor  # [B, Q] bool, a supervised label (accuracy counts these, unweighted)
    anchors: torch.Tensor  # [B, A] anchor positions (0 for padding blocks)
    anchor_valid: torch.Tensor  # [B, A] bool; False = padding block
    # [n] int64: the flat indices (into B * Q) where `valid`, found on the host with the blocks,
    # so the fused loss runs the LM head on those rows only (no device value read to find them)
    loss_rows: torch.Tensor
    block_size: int
    # [B, Q] the true token before the one each position predicts, ids[a + k + label_offset - 1]
    # (DSpark's Markov head and DFlash2's selector read it teacher-forced: the anchor for the
    # first predicting position), 0 where that falls outside the sample; built on request
    # (`with_prev_ids`, always with label_offset=1).
    prev_ids: torch.Tensor | None = None
    # Blocks whose positions predict the token after them (label_offset=1, DSpark) also carry
    # where the target's final hidden state gives each labelled row's distribution for token
    # a + k + 1: the row's own position a + k. Overlapping blocks share positions, so the
    # target's LM head runs once per distinct one: `final_positions` [U] the distinct flat
    # indices (into B * S), ascending; `final_index` [n] each `loss_rows` row's place among them,
    # also kept on the host (`final_index_host`, never moved) so the fused loss finds each
    # chunk's span of positions without reading the device.
    final_positions: torch.Tensor | None = None
    final_index: torch.Tensor | None = None
    final_index_host: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> DraftBlocks:
        names = (
            "block_ids",
            "positions",
            "labels",
            "weights",
            "valid",
            "anchors",
            "anchor_valid",
            "loss_rows",
            "prev_ids",
            "final_positions",
            "final_index",
        )
        moved = {
            name: None
            if getattr(self, name) is None
            else host_to_device(getattr(self, name), device, non_blocking)
            for name in names
        }
        return DraftBlocks(**moved, block_size=self.block_size, final_index_host=self.final_index_host)


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    sample_ids: list[int],
    *,
    epoch: int,
    seed: int,
    block_size: int,
    num_anchors: int,
    mask_token_id: int,
    weights: torch.Tensor,
    keep_fraction: float = 0.0,
    label_offset: int = 0,
    with_prev_ids: bool = False,
) -> DraftBlocks:
    """Draw anchors per sample and lay out their blocks, labels and weights (host tensors);
    `weights` [block_size]: each block position's loss weight (`position_weights`).

    label_offset: position k predicts token a + k + label_offset. 0 (DFlash): position 0 is the
    anchor and predicts nothing. 1 (DSpark, deepseek-ai/DeepSpec `build_eval_mask`): every
    position predicts the token after it, and supervision stops at a block's first unsupervised
    label (a contiguous prefix, as drafts are accepted); the blocks then carry `prev_ids` and
    where each labelled row's target distribution is read (`final_positions`, `final_index`).
    with_prev_ids: carry `prev_ids` at label_offset 0 too (DFlash2's selector).

    keep_fraction (noise=mask_ramp): each non-anchor block position keeps its true token instead
    of MASK with this probability; such positions carry no loss and no accuracy.
    """
    ids_np = input_ids.numpy()
    mask_np = loss_mask.numpy()
    batch, seq_len = ids_np.shape
    rngs = [sample_rng(seed, epoch, sample_id) for sample_id in sample_ids]
    anchors, anchor_valid, keep = _draw_anchors(
        mask_np, lengths, rngs, block_size=block_size, num_anchors=num_anchors, keep_fraction=keep_fraction
    )
    num_blocks = anchors.shape[1]
    positions = anchors[:, :, None] + np.arange(block_size)  # [B, A, Bs]
    sample_lengths = lengths.numpy()[:, None, None]
    in_range = positions < sample_lengths
    gather_pos = np.minimum(positions, seq_len - 1)
    true_ids = _take(ids_np, gather_pos)
    keep &= in_range
    block_ids = np.where(keep, true_ids, mask_token_id)
    block_ids[:, :, 0] = true_ids[:, :, 0]

    labels, valid = _labels(
        ids_np,
        mask_np,
        positions,
        sample_lengths,
        anchor_valid=anchor_valid,
        keep=keep,
        label_offset=label_offset,
    )
    weights = weights.numpy()[None, None, :] * valid

    flat = (batch, num_blocks * block_size)
    loss_rows = np.flatnonzero(valid.reshape(-1))
    extra = _shifted_label_fields(
        ids_np,
        positions,
        sample_lengths,
        gather_pos,
        loss_rows=loss_rows,
        label_offset=label_offset,
        with_prev_ids=with_prev_ids,
    )
    return DraftBlocks(
        block_ids=torch.from_numpy(block_ids.reshape(flat)),
        positions=torch.from_numpy(positions.reshape(flat)),
        labels=torch.from_numpy(labels.reshape(flat)),
        weights=torch.from_numpy(weights.reshape(flat).astype(np.float32)),
        valid=torch.from_numpy(valid.reshape(flat)),
        anchors=torch.from_numpy(anchors),
        anchor_valid=torch.from_numpy(anchor_valid),
        loss_rows=torch.from_numpy(loss_rows),
        block_size=block_size,
        **extra,
    )


def _take(rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`rows[b, positions[b, ...]]` for each row b: [B, S] at [B, A, Bs] positions."""
    batch = rows.shape[0]
    return np.take_along_axis(rows, positions.reshape(batch, -1), axis=1).reshape(positions.shape)


def _labels(
    ids_np: np.ndarray,
    mask_np: np.ndarray,
    positions: np.ndarray,
    sample_lengths: np.ndarray,
    *,
    anchor_valid: np.ndarray,
    keep: np.ndarray,
    label_offset: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Each block position's label (0 where none) and whether it is supervised ([B, A, Bs]
    each): in its sample, a loss-masked token, its block a real anchor's and not kept true."""
    label_pos = np.minimum(positions + label_offset, ids_np.shape[1] - 1)
    label_in_range = positions + label_offset < sample_lengths
    valid = label_in_range & _take(mask_np, label_pos).astype(bool) & anchor_valid[:, :, None] & ~keep
    if label_offset == 0:
        valid[:, :, 0] = False  # position 0 is the anchor itself: nothing to predict
    else:
        valid = np.cumprod(valid, axis=2).astype(bool)  # a contiguous supervised prefix
    return np.where(valid, _take(ids_np, label_pos), 0), valid


def _draw_anchors(
    mask_np: np.ndarray,
    lengths: torch.Tensor,
    rngs: list[np.random.Generator],
    *,
    block_size: int,
    num_anchors: int,
    keep_fraction: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sample's anchors from its own stream (`rngs`, `sample_rng`'s), padded to the batch's
    most: (anchors [B, A], which are real [B, A], block positions keeping their true token [B, A, Bs])."""
    batch = mask_np.shape[0]
    per_sample, keep_draws = [], []
    for row, rng in enumerate(rngs):
        length = int(lengths[row])
        anchors = sample_anchors(mask_np[row, :length], num_anchors, rng)
        per_sample.append(anchors)
        # Drawn whether or not noise is on, so the anchor stream is the same in every noise mode.
        keep_draws.append(rng.random((len(anchors), block_size)))
    num_blocks = max(1, max(len(a) for a in per_sample))  # >= 1: an empty batch still has a shape

    anchors = np.zeros((batch, num_blocks), dtype=np.int64)
    anchor_valid = np.zeros((batch, num_blocks), dtype=bool)
    keep = np.zeros((batch, num_blocks, block_size), dtype=bool)
    for row, sample_anchors_ in enumerate(per_sample):
        anchors[row, : len(sample_anchors_)] = sample_anchors_
        anchor_valid[row, : len(sample_anchors_)] = True
        keep[row, : len(sample_anchors_)] = keep_draws[row] < keep_fraction
    keep[:, :, 0] = False
    return anchors, anchor_valid, keep


def _shifted_label_fields(
    ids_np: np.ndarray,
    positions: np.ndarray,
    sample_lengths: np.ndarray,
    gather_pos: np.ndarray,
    *,
    loss_rows: np.ndarray,
    label_offset: int,
    with_prev_ids: bool,
) -> dict[str, torch.Tensor]:
    """DraftBlocks' optional fields: `prev_ids` (the token before each position's label) at a
    label_offset or with_prev_ids, and at a label_offset where each labelled row's target
    distribution is read (`final_positions`, `final_index`, `final_index_host`)."""
    batch, seq_len = ids_np.shape
    flat = (batch, positions.shape[1] * positions.shape[2])
    extra = {}
    if label_offset != 0 or with_prev_ids:
        prev_pos = positions + label_offset - 1
        prev_in_range = (prev_pos >= 0) & (prev_pos < sample_lengths)
        prev_ids = _take(ids_np, np.clip(prev_pos, 0, seq_len - 1))
        extra["prev_ids"] = torch.from_numpy(np.where(prev_in_range, prev_ids, 0).reshape(flat))
    if label_offset != 0:
        sample_start = (np.arange(batch) * seq_len)[:, None, None]
        final_rows = (sample_start + gather_pos).reshape(-1)[loss_rows]
        final_positions, final_index = np.unique(final_rows, return_inverse=True)
        extra["final_positions"] = torch.from_numpy(final_positions)
        extra["final_index"] = torch.from_numpy(final_index.reshape(-1))
        extra["final_index_host"] = extra["final_index"]  # `to` moves the other, not this one
    return extra


def block_attention_mask(
    anchors_BA: torch.Tensor,
    anchor_valid_BA: torch.Tensor,
    ctx_len: int,
    block_size: int,
    window: int | None = None,
) -> torch.Tensor:
    """Dense bool mask [B, Q, S + Q] (True = visible) for queries of block j with anchor a_j.

    - context key i is visible iff i < a_j, strictly: the anchor's own target hidden state does
      not exist yet at inference (the anchor is the token the target just emitted);
    - window (a sliding_attention layer): also iff p - i < window, p = a_j + k the query's
      position: the keys a flash-attention window of that size keeps, as the serving engines
      and the reference run it;
    - every key of the query's own block is visible (bidirectional, no causal mask in the block,
      in every layer type);
    - keys of other blocks never are.
    Padding blocks see no context and no other block; they see only their own keys, which keeps
    every softmax row finite (an all-masked row is NaN), and carry no loss.
    """
    bsz, num_blocks = anchors_BA.shape
    device = anchors_BA.device
    ctx_idx = torch.arange(ctx_len, device=device)
    anchor_BQ = anchors_BA.repeat_interleave(block_size, dim=1)
    ctx_visible = (ctx_idx[None, None, :] < anchor_BQ[:, :, None]) & anchor_valid_BA.repeat_interleave(
        block_size, dim=1
    )[:, :, None]  # [B, Q, S]
    query = torch.arange(num_blocks * block_size, device=device)
    if window is not None:
        position_BQ = anchor_BQ + query % block_size
        ctx_visible &= ctx_idx[None, None, :] > position_BQ[:, :, None] - window
    block_of = query // block_size
    same_block = (block_of[:, None] == block_of[None, :]).expand(bsz, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx_visible, same_block], dim=2)


def layer_masks(
    anchors_BA: torch.Tensor,
    anchor_valid_BA: torch.Tensor,
    ctx_len: int,
    block_size: int,
    windows: tuple[int | None, ...],
) -> dict[int | None, torch.Tensor]:
    """`block_attention_mask` for each distinct window of a drafter's layers (None: full)."""
    return {
        window: block_attention_mask(anchors_BA, anchor_valid_BA, ctx_len, block_size, window)
        for window in windows
    }
