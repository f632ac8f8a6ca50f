"""The drafter's context keys/values in a static cache, and its block forward over them.

The context keys/values of position p depend only on the target features at p, so they are
written once, when the target computes those features (the verification forward of the round
that commits p), at their absolute positions. A draft reads the cache up to a bucketed length
`kv_len` through the training mask builder (`layer_masks`: context strictly before the
anchor, the whole block bidirectionally), so entries at or after the anchor — features of
rejected drafts, or stale ones from an earlier sequence — are never seen.

A DSpark drafter drafts its B tokens left to right with the Markov bias inside the same
capturable function (dflash.decoding.reference.dspark_block, the reference decoder's code), and
returns the confidence head's survival probabilities beside them. A DFlash2 drafter's selector
walks its B-1 draft positions the same way (dflash.decoding.reference.dflash2_block), the unary
argmax returned beside the drafts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash.decoding.kv_cache import StaticKV
from dflash.decoding.reference import DraftChooser, dflash2_block, drafts_per_round, dspark_block
from dflash.models.compile import compile_shared
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import FrozenTarget
from dflash.step.blocks import layer_masks


class StaticCacheDrafter(nn.Module):
    """`compile_backend` (None: eager): the draft and the context write each compiled whole (a
    few drafter layers: one small graph each)."""

    def __init__(
        self, drafter: DFlashDrafter, target: FrozenTarget, *, max_len: int, compile_backend: Any = None
    ):
        super().__init__()
        self.drafter, self.target = drafter, target
        config = drafter.config
        self.block_size = drafter.block_size
        device = target.device
        self.kv = StaticKV(
            layers=config.num_hidden_layers,
            slots=1,
            kv_heads=config.num_key_value_heads,
            max_len=max_len,
            head_dim=config.head_dim,
            dtype=drafter.fc.weight.dtype,
            device=device,
        )
        mask_row = torch.full((1, self.block_size), drafter.mask_token_id, device=device)
        self.register_buffer("mask_row", mask_row, persistent=False)
        self.register_buffer("offsets", torch.arange(self.block_size, device=device), persistent=False)
        # A round verifies [anchor, drafts]: B positions after a DFlash block, B + 1 after DSpark's.
        self.drafts = drafts_per_round(drafter)
        self.register_buffer("verify_offsets", torch.arange(self.drafts + 1, device=device), persistent=False)
        self._write, self._draft, self._hidden = self._write_eager, self._draft_eager, self._hidden_eager
        if compile_backend is not None:
            self._write = compile_shared(self._write_eager, backend=compile_backend, dynamic=True)
            self._draft = compile_shared(self._draft_eager, backend=compile_backend, dynamic=True)
            # DSpark and DFlash2: the layers compiled; the left-to-right loop after them (Markov
            # head, candidate selector) stays eager (a graph captures it all the same).
            self._hidden = compile_shared(self._hidden_eager, backend=compile_backend, dynamic=True)

    @torch.no_grad()
    def write(self, features_1QF: torch.Tensor, positions_1Q: torch.Tensor) -> None:
        """Context keys/values of the target features at `positions_1Q` into the cache."""
        self._write(features_1QF, positions_1Q)

    @torch.no_grad()
    def draft(self, anchor_1: torch.Tensor, anchor_pos_1: torch.Tensor, *, kv_len: int) -> torch.Tensor:
        """The drafter's B-1 argmax guesses [B-1] after the anchor token at `anchor_pos_1`, from
        the context before it. Capturable: device tensors in, no host reads."""
        return self._draft(anchor_1, anchor_pos_1, kv_len=kv_len)

    @torch.no_grad()
    def draft_dspark(
        self,
        anchor_1: torch.Tensor,
        anchor_pos_1: torch.Tensor,
        noise_BV: torch.Tensor | None = None,
        *,
        kv_len: int,
        temperature: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A DSpark drafter's B drafts [B], left to right with the Markov bias (argmax, or with
        `noise_BV` Gumbel-max samples at `temperature`), and their survival probabilities [B]
        (None without a confidence head). Capturable."""
        hidden = self._hidden(anchor_1, anchor_pos_1, kv_len=kv_len)
        choose = DraftChooser() if noise_BV is None else DraftChooser(temperature, noise_BV)
        return dspark_block(self.drafter, self.target, hidden_1BH=hidden, anchor_1=anchor_1, choose=choose)

    @torch.no_grad()
    def draft_dflash2(
        self,
        anchor_1: torch.Tensor,
        anchor_pos_1: torch.Tensor,
        noise_BV: torch.Tensor | None = None,
        *,
        kv_len: int,
        temperature: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A DFlash2 drafter's B-1 drafts [B-1], picked by its selector among each position's
        top-K candidates (the best score, or with `noise_BV` a Gumbel-max sample at
        `temperature`), and the unary argmax [B-1] beside them. Capturable."""
        hidden = self._hidden(anchor_1, anchor_pos_1, kv_len=kv_len)
        choose = DraftChooser() if noise_BV is None else DraftChooser(temperature, noise_BV)
        return dflash2_block(self.drafter, self.target, hidden_1BH=hidden, anchor_1=anchor_1, choose=choose)

    def _write_eager(self, features_1QF: torch.Tensor, positions_1Q: torch.Tensor) -> None:
        for index, (k, v) in enumerate(self.drafter.context_kv(features_1QF, positions_1Q)):
            self.kv.write(index, positions_1Q, k, v)

    def _draft_eager(
        self, anchor_1: torch.Tensor, anchor_pos_1: torch.Tensor, *, kv_len: int
    ) -> torch.Tensor:
        hidden = self._hidden_eager(anchor_1, anchor_pos_1, kv_len=kv_len)
        return self.target.lm_head(hidden.to(self.target.lm_head.weight.dtype))[0, 1:].argmax(-1)

    def _hidden_eager(
        self, anchor_1: torch.Tensor, anchor_pos_1: torch.Tensor, *, kv_len: int
    ) -> torch.Tensor:
        """The block's hidden states [1, B, H] (after the drafter's final norm)."""
        block_ids = torch.cat([anchor_1.view(1, 1), self.mask_row[:, 1:]], dim=1)
        positions = anchor_pos_1.view(1, 1) + self.offsets
        mask = layer_masks(
            anchor_pos_1.view(1, 1),
            torch.ones((1, 1), dtype=torch.bool, device=anchor_1.device),
            ctx_len=kv_len,
            block_size=self.block_size,
            windows=self.drafter.windows,
        )
        context = [self.kv.prefix(index, kv_len) for index in range(len(self.kv.keys))]
        return self.drafter.draft(context, self.target.embed_tokens(block_ids), positions, mask)
