"""The drafter's context keys/values in a static cache, and its block forward over them.

The context keys/values of position p depend only on the target features at p, so they are
written once, when the target computes those features (the verification forward of the round
that commits p), at their absolute positions. A draft reads the cache up to a bucketed length
`kv_len` through the training mask builder (`layer_masks`: context strictly before the
anchor, the whole block bidirectionally), so entries at or after the anchor — features of
rejected drafts, or stale ones from an earlier sequence — are never seen.

The block's drafts come from the drafter's own `draft_block` (the code the reference decoder
runs), inside the same capturable function: DFlash's argmax, DSpark's B tokens left to right with
the Markov bias (its survival probabilities beside them), DFlash2's selector walk (the unary
argmax beside it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dflash.decoding.kv_cache import StaticKV
from dflash.decoding.reference import DraftChooser
from dflash.drafters.backbone import DFlashDrafter
from dflash.step.blocks import layer_masks
from dflash.target.model import FrozenTarget
from dflash.torch_runtime.compile import compile_shared


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
        # A round verifies [anchor, drafts] (the drafter's `verify_len`).
        self.drafts = drafter.drafts_per_block
        self.register_buffer(
            "verify_offsets", torch.arange(drafter.verify_len, device=device), persistent=False
        )
        # Each position's projected context row, for a drafter that reads the one before its
        # anchor; written with the keys/values, so a rejected draft's row is overwritten in turn.
        rows = None
        if drafter.reads_anchor_row:
            rows = torch.zeros(max_len, config.hidden_size, dtype=drafter.fc.weight.dtype, device=device)
        self.register_buffer("anchor_rows", rows, persistent=False)
        self._write, self._hidden = self._write_eager, self._hidden_eager
        if compile_backend is not None:
            self._write = compile_shared(self._write_eager, backend=compile_backend, dynamic=True)
            # The layers compiled; a variant's left-to-right walk after them (Markov head,
            # candidate selector) stays eager (a graph captures it all the same).
            self._hidden = compile_shared(self._hidden_eager, backend=compile_backend, dynamic=True)

    @torch.no_grad()
    def write(self, features_1QF: torch.Tensor, positions_1Q: torch.Tensor) -> None:
        """Context keys/values of the target features at `positions_1Q` into the cache."""
        self._write(features_1QF, positions_1Q)

    @torch.no_grad()
    def draft(self, anchor_1: torch.Tensor, anchor_pos_1: torch.Tensor, *, kv_len: int) -> torch.Tensor:
        """The drafter's greedy drafts [drafts_per_block] after the anchor token at `anchor_pos_1`,
        from the context before it. Capturable: device tensors in, no host reads."""
        return self.draft_block(anchor_1, anchor_pos_1, kv_len=kv_len)[0]

    @torch.no_grad()
    def draft_block(
        self,
        anchor_1: torch.Tensor,
        anchor_pos_1: torch.Tensor,
        noise_BV: torch.Tensor | None = None,
        *,
        kv_len: int,
        temperature: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's drafts [drafts_per_block] (argmax, or with `noise_BV` Gumbel-max samples
        at `temperature` where the variant samples) and its per-round extra beside them
        (`DFlashDrafter.draft_block`). Capturable."""
        hidden = self._hidden(anchor_1, anchor_pos_1, kv_len=kv_len)
        choose = DraftChooser() if noise_BV is None else DraftChooser(temperature, noise_BV)
        inputs = {}
        if self.anchor_rows is not None:
            row = self.anchor_rows.index_select(0, anchor_pos_1.view(1) - 1)
            inputs = {"embed_tokens": self.target.embed_tokens, "anchor_row_1H": row}
        return self.drafter.draft_block(self.target.lm_head, hidden, anchor_1, choose, **inputs)

    def round_draft(
        self,
        anchor_1: torch.Tensor,
        anchor_pos_1: torch.Tensor,
        noise_BV: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A decoding round's draft (`draft_block`'s arguments): `draft` when it is greedy with
        nothing beside it (what a test's oracle replaces), else the variant's walk. Capturable."""
        if noise_BV is None and self.drafter.round_extra is None:
            return self.draft(anchor_1, anchor_pos_1, kv_len=kwargs["kv_len"]), None
        return self.draft_block(anchor_1, anchor_pos_1, noise_BV, **kwargs)

    def _write_eager(self, features_1QF: torch.Tensor, positions_1Q: torch.Tensor) -> None:
        for index, (k, v) in enumerate(self.drafter.context_kv(features_1QF, positions_1Q)):
            self.kv.write(index, positions_1Q, k, v)
        if self.anchor_rows is not None:
            self.anchor_rows.index_copy_(0, positions_1Q[0], self.drafter.context(features_1QF)[0])

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
