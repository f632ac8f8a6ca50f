"""LiLiCorr loss: DFlash's weighted CE plus the lattice terms of the recipe, with no outer factor.

With the lattice of a block (dflash/drafters/lilicorr.py: candidates C_s = top-K of the drafter's
logits at slot s = block position s + 1, start factors z_0 = start, pair factors pair[s]),
g_s the true token's index in C_s, and the node factors teacher-forced on the true path,
    z_0 = start,    z_s = pair[s - 1][g_{s-1}, :]        (s >= 1)
each slot s is supervised iff its block's every slot is a supervised label and the true token is
in C_0 .. C_s (the longest prefix the lattice can produce at all), and over supervised slots:
    CE_s     = -log softmax(z_s)[g_s]
    HINGE_s  = relu(margin - (z_s[g_s] - max_{k != g_s} z_s[k]))
    PEN_s    = sum_k softmax(z_s)_k relu(T_s[gold] - T_s[C_s,k])
T_s the target's logits for the token of slot s (its LM head on its final hidden state at
position a + s, taken in process: no logits cross devices). The penalty is the head's expected
rejection weight: zero at the true token and at candidates the target scores at least as high,
large on confident distractors. With n the supervised slots (at least 1):
    L = DFlash CE (sum_k w_k CE_k / sum_k w_k) + (w_ce sum CE + w_margin sum HINGE + w_pen sum PEN) / n
(ModelOpt's `lilicorr.yaml`: w_ce 0.25, w_margin 0, w_pen 0.25, margin 2.0). dflash reduces a
step as one numerator over one weight (summed across replicas before the division), so the
lattice mean enters the numerator times this batch's weight sum: one replica's loss is exactly L;
with several, each replica's lattice mean counts in proportion to its weight.

The lattice terms reach the backbone through the candidates' log-probabilities (recomputed from
the live logits), its hidden states and the anchor row (fc, hidden_norm); the candidates'
embeddings are the target's frozen table.

Figures: `correct`, `accepted`, `rounds` score the greedy walk's picks (what decoding drafts),
not the backbone's argmax, which is reported beside them (`top1_*`) with the lattice's oracle
(the true token in every C_s of the prefix) and the three terms' sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafters.lilicorr import LiLiCorrDrafter, greedy_walk
from dflash.step.blocks import DraftBlocks
from dflash.step.loss import LossStats, block_acceptance, draft_loss


@dataclass(frozen=True)
class LatticeWeights:
    ce: float
    margin: float
    penalty: float
    margin_width: float


@dataclass
class LiLiCorrLossStats(LossStats):
    """LossStats (the numerator holds both parts; correct/accepted/rounds score the walk's picks)
    plus the lattice's sums; device tensors, no host sync."""

    ce: torch.Tensor  # sum_k w_k CE_k (DFlash's term)
    lattice_ce: torch.Tensor  # sum over supervised slots of CE_s
    lattice_margin: torch.Tensor  # ... of HINGE_s
    lattice_penalty: torch.Tensor  # ... of PEN_s
    lattice_slots: torch.Tensor  # supervised slots
    top1_accepted: torch.Tensor  # leading runs of the backbone's argmax hits
    top1_rounds: torch.Tensor
    oracle_accepted: torch.Tensor  # leading runs of slots whose true token is a candidate
    oracle_rounds: torch.Tensor


def node_factors(start_NK: torch.Tensor, pair_NSKK: torch.Tensor, gold_NS: torch.Tensor) -> torch.Tensor:
    """z [N, S, K]: z_0 = start, z_s = pair[s - 1][gold_{s-1}, :] (the true path's factors)."""
    topk = start_NK.shape[-1]
    previous = gold_NS[:, :-1, None, None].expand(-1, -1, 1, topk)
    rows = pair_NSKK.gather(2, previous)[:, :, 0]
    return torch.cat([start_NK[:, None], rows], dim=1)


def lattice_terms(
    nodes_NSK: torch.Tensor,
    gold_NS: torch.Tensor,
    supervised_NS: torch.Tensor,
    rejection_NSK: torch.Tensor,
    margin_width: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum CE_s, sum HINGE_s, sum PEN_s) over the supervised slots; `rejection` is
    relu(T[gold] - T[candidate]) per candidate (no gradient)."""
    mask = supervised_NS.float()
    log_probs = F.log_softmax(nodes_NSK.float(), dim=-1)
    ce = -log_probs.gather(-1, gold_NS[..., None])[..., 0]
    gold_score = nodes_NSK.gather(-1, gold_NS[..., None])[..., 0]
    is_gold = F.one_hot(gold_NS, nodes_NSK.shape[-1]).bool()
    runner_up = nodes_NSK.masked_fill(is_gold, float("-inf")).max(dim=-1).values
    # No competitor (K = 1): the runner-up is -inf and the hinge 0, nothing to separate from.
    hinge = torch.relu(margin_width - (gold_score - runner_up))
    penalty = (log_probs.exp() * rejection_NSK).sum(dim=-1)
    return (ce * mask).sum(), (hinge * mask).sum(), (penalty * mask).sum()


def _slots(per_position_BQ: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, Q, ...] -> [B A, S, ...]: each block's positions 1..B-1 (its draft slots)."""
    bsz = per_position_BQ.shape[0]
    blocks = per_position_BQ.view(bsz, -1, block_size, *per_position_BQ.shape[2:])[:, :, 1:]
    return blocks.flatten(0, 1)


@torch.no_grad()
def _rejection_weights(
    *,
    final_BSH: torch.Tensor,
    lm_head: nn.Module,
    blocks: DraftBlocks,
    ids_NSK: torch.Tensor,
    gold_NS: torch.Tensor,
) -> torch.Tensor:
    """relu(T_s[gold] - T_s[c]) per candidate: T_s the target's logits at position a + s (the
    ones for slot s's token), from the LM head's rows of the candidates only."""
    bsz, seq_len, hidden = final_BSH.shape
    slots = ids_NSK.shape[1]
    offsets = torch.arange(slots, device=final_BSH.device)
    positions = (blocks.anchors.reshape(-1, 1) + offsets).clamp(max=seq_len - 1)
    sample = torch.arange(bsz, device=final_BSH.device).repeat_interleave(blocks.anchors.shape[1])
    rows_NSH = final_BSH[sample[:, None], positions].to(lm_head.weight.dtype)
    candidate_logits = torch.einsum("nsh,nskh->nsk", rows_NSH, lm_head.weight[ids_NSK]).float()
    gold_logit = candidate_logits.gather(-1, gold_NS[..., None])
    return (gold_logit - candidate_logits).clamp_min(0.0)


def lilicorr_loss(
    hidden_BQH: torch.Tensor,
    *,
    lm_head: nn.Module,
    embed_tokens: nn.Module,
    drafter: LiLiCorrDrafter,
    blocks: DraftBlocks,
    features_BSF: torch.Tensor,
    final_BSH: torch.Tensor,
    weights: LatticeWeights,
    logits_chunk: int = 0,
    compiled: bool = False,
) -> LiLiCorrLossStats:
    """The LiLiCorr loss statistics of one batch of blocks; `features_BSF` the fused target
    features (the anchor rows), `final_BSH` the target's final hidden state (the penalty)."""
    base = draft_loss(hidden_BQH, lm_head, blocks, logits_chunk, compiled=compiled)
    block_size = blocks.block_size
    hidden_NSH = _slots(hidden_BQH, block_size)
    labels_NS = _slots(blocks.labels, block_size)
    valid_NS = _slots(blocks.valid, block_size)
    rows_BAH, has_row_BA = drafter.anchor_rows(features_BSF, blocks.anchors)
    ids, start, pair = drafter.score(
        logits_NSV=lm_head(hidden_NSH.to(lm_head.weight.dtype)),
        hidden_NSH=hidden_NSH,
        embed_tokens=embed_tokens,
        anchor_row_NH=rows_BAH.flatten(0, 1),
        anchor_valid_N=(has_row_BA & blocks.anchor_valid).flatten(),
    )
    with torch.no_grad():
        is_gold = ids == labels_NS[..., None]
        in_lattice = is_gold.any(dim=-1)
        gold = is_gold.int().argmax(dim=-1)
        # A block trains the lattice only when every slot is a label (as the reference does).
        supervised = in_lattice.int().cumprod(dim=-1).bool() & valid_NS.all(dim=-1, keepdim=True)
        rejection = torch.zeros(ids.shape, device=ids.device)
        if weights.penalty > 0:
            rejection = _rejection_weights(
                final_BSH=final_BSH, lm_head=lm_head, blocks=blocks, ids_NSK=ids, gold_NS=gold
            )
    nodes = node_factors(start, pair, gold)
    ce, hinge, penalty = lattice_terms(nodes, gold, supervised, rejection, weights.margin_width)
    slots = supervised.sum().float()
    lattice = (weights.ce * ce + weights.margin * hinge + weights.penalty * penalty) / slots.clamp_min(1.0)
    with torch.no_grad():
        picks = ids.gather(-1, greedy_walk(start, pair)[..., None])[..., 0]
        grid_shape = (blocks.labels.shape[0], -1, block_size)
        valid = blocks.valid.view(grid_shape)

        def grid(flags_NS: torch.Tensor) -> torch.Tensor:
            """Slot flags back to [B, A, block_size] (position 0, the anchor, predicts nothing)."""
            padded = F.pad(flags_NS & valid_NS, (1, 0), value=False)
            return padded.view(grid_shape)

        walk_hits = grid(picks == labels_NS)
        accepted, counted_blocks, rounds = block_acceptance(walk_hits, valid)
        top1_accepted, _, top1_rounds = block_acceptance(grid(ids[..., 0] == labels_NS), valid)
        oracle_accepted, _, oracle_rounds = block_acceptance(grid(in_lattice), valid)
    return LiLiCorrLossStats(
        weighted_ce=base.weighted_ce + lattice * base.weight.detach(),
        weight=base.weight,
        correct=walk_hits.sum(dim=(0, 1)).float(),
        counted=base.counted,
        accepted=accepted,
        blocks=counted_blocks,
        rounds=rounds,
        ce=base.weighted_ce.detach(),
        lattice_ce=ce.detach(),
        lattice_margin=hinge.detach(),
        lattice_penalty=penalty.detach(),
        lattice_slots=slots,
        top1_accepted=top1_accepted,
        top1_rounds=top1_rounds,
        oracle_accepted=oracle_accepted,
        oracle_rounds=oracle_rounds,
    )
