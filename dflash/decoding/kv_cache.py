"""Per-layer static key/value buffers, written at absolute positions.

One tensor per layer, not views of one stacked tensor: torch.compile turns an in-place write
into a view of a larger buffer into a copy of the whole buffer (a `select_scatter` of every
layer's cache, per layer, per step), while a write into a whole graph input becomes an in-place
`index_put_`. Eager code is the same either way.
"""

from __future__ import annotations

import torch


class StaticKV:
    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (slots, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def write(
        self, layer: int, positions_SQ: torch.Tensor, k_SHQD: torch.Tensor, v_SHQD: torch.Tensor
    ) -> None:
        """Keys/values [S, Hkv, Q, D] of every slot at positions [S, Q] (distinct within a row)."""
        write_layer(self.keys[layer], self.values[layer], positions_SQ, k_SHQD, v_SHQD)

    def write_prefix(
        self, layer: int, rows_R: torch.Tensor, k_RHPD: torch.Tensor, v_RHPD: torch.Tensor
    ) -> None:
        """Keys/values of fresh sequences at positions 0..P-1 of slots `rows_R`."""
        length = k_RHPD.shape[2]
        self.keys[layer][rows_R, :, :length] = k_RHPD
        self.values[layer][rows_R, :, :length] = v_RHPD

    def prefix(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, :kv_len], self.values[layer][:, :, :kv_len]


def write_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions_SQ: torch.Tensor,
    k_SHQD: torch.Tensor,
    v_SHQD: torch.Tensor,
) -> None:
    """One layer's cache write (`StaticKV.write`), on the layer's buffers themselves: a compiled
    per-layer function takes them as inputs and writes them in place."""
    rows = torch.arange(positions_SQ.shape[0], device=positions_SQ.device)[:, None].expand_as(positions_SQ)
    # Advanced indices around a slice put the indexed dims first: values as [S, Q, Hkv, D].
    keys[rows, :, positions_SQ] = k_SHQD.transpose(1, 2)
    values[rows, :, positions_SQ] = v_SHQD.transpose(1, 2)
