"""How a round's drafts are verified at a temperature > 0.

`match` (dflash's default): the target samples its own token at every position, and a draft is
kept while it equals that sample. Exact (every committed token is the target's sample given a
committed prefix), but a draft d drawn from the drafter's distribution p survives with
probability sum_d p(d) q(d) against the target's q.

`rejection`: speculative sampling (Leviathan et al. 2023; Chen et al. 2023), the rule SGLang,
vLLM and TensorRT-LLM verify with at a temperature > 0, and the protocol the DSpark paper's
acceptance figures use (temperature 1). Draft i is kept with probability min(1, q_i(d_i) /
p_i(d_i)); at the first rejection the token is sampled from the residual max(0, q_i - p_i)
(normalised), and after a block kept whole the bonus from q_n. The output has the target's
distribution exactly, and a draft survives with probability 1 - TV(p, q), what DSpark's loss
trains for. An argmax draft (p one-hot) survives with q(d) under both rules.

At temperature 0 both are greedy verification: a draft is kept while it is the target's argmax.
"""

from __future__ import annotations

import torch

from dflash.config.schema import VerifyRule

__all__ = ["VerifyRule", "rejection_round"]


def rejection_round(
    draft: list[int],
    *,
    draft_probs_PV: torch.Tensor | None,
    target_logits_NV: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """One round verified by speculative sampling: how many of the P drafts are kept, and the token
    that follows them (the residual's sample at the first rejection, else the bonus).
    `draft_probs_PV`: the distribution each draft was drawn from (None: argmax drafts, p one-hot).
    `target_logits_NV`: the target's logits at the N = P + 1 positions the round verifies."""
    if temperature <= 0:
        raise ValueError("rejection sampling verifies sampled decoding: temperature > 0")
    positions = len(draft)
    q_NV = torch.softmax(target_logits_NV.float() / temperature, dim=-1)
    ids_P = torch.tensor(draft, device=q_NV.device, dtype=torch.long)
    q_of_draft_P = q_NV[:positions].gather(1, ids_P[:, None])[:, 0]
    if draft_probs_PV is None:
        p_PV = torch.zeros_like(q_NV[:positions]).scatter_(1, ids_P[:, None], 1.0)
    else:
        p_PV = draft_probs_PV.float().to(q_NV.device)
    p_of_draft_P = p_PV.gather(1, ids_P[:, None])[:, 0]
    uniform_P = torch.rand(positions, generator=generator, device=q_NV.device)
    # u < q/p, written without the division (p(d) > 0 for any drawn draft)
    kept_P = uniform_P * p_of_draft_P < q_of_draft_P
    rejected = (~kept_P).nonzero()
    accepted = int(rejected[0, 0]) if len(rejected) else positions
    if accepted < positions:
        follow = (q_NV[accepted] - p_PV[accepted]).clamp_(min=0)
    else:
        follow = q_NV[positions]
    token = torch.multinomial(follow / follow.sum(), 1, generator=generator)
    return accepted, int(token)
