"""What a drafter needs of the frozen target on its own device: the embedding table and LM head.

The drafter embeds its blocks with the target's `embed_tokens` and scores them with the target's
`lm_head`. On a device the target does not live on (gpu=split) those two tables are copied
there once, frozen, and shared read-only by every replica on that device. Nothing else of the
target is needed there:
- the context features arrive from the target worker, already computed;
- the target's final norm is not used: the drafter ends in its own `norm` (the z-lab layout)
  before the LM head, exactly as at inference;
- the rotary tables are the drafter's own (recomputed from its config).
The copies are never trained and never checkpointed: exports hold only drafter weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from dflash.target.model import FrozenTarget


class TargetHead(nn.Module):
    """The target's frozen `embed_tokens` and `lm_head`, on one device."""

    def __init__(self, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.requires_grad_(False)

    @classmethod
    def of(cls, target: FrozenTarget) -> TargetHead:
        """The target's own modules (the drafter shares the target's device): no copy."""
        return cls(target.embed_tokens, target.lm_head)

    @classmethod
    def copy_of(cls, target: FrozenTarget, device: torch.device) -> TargetHead:
        """Copies on `device`, made straight from the target's tensors (no temporary on the
        target's device). Tied weights (Llama-style `tie_word_embeddings`) stay one tensor: both
        modules are copied through one memo, so the shared weight is copied once."""
        memo: dict[int, nn.Parameter] = {}
        for module in (target.embed_tokens, target.lm_head):
            for param in module.parameters():
                if id(param) not in memo:
                    memo[id(param)] = nn.Parameter(param.detach().to(device), requires_grad=False)
        return cls(copy.deepcopy(target.embed_tokens, memo), copy.deepcopy(target.lm_head, memo))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device


def heads_for(drafter_devices: list[str], targets: list[FrozenTarget]) -> list[TargetHead]:
    """One head per drafter replica: a target's own tables on a device it lives on, else one
    copy per device, shared by the replicas there."""
    by_device = {t.device: TargetHead.of(t) for t in targets}
    heads = []
    for name in drafter_devices:
        device = torch.device(name)
        if device not in by_device:
            by_device[device] = TargetHead.copy_of(targets[0], device)
        heads.append(by_device[device])
    return heads
