"""Token dataset: concatenated ids and loss masks with offsets, stored as safetensors (no pickle)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


class TokenDataset:
    """Samples of (input_ids, loss_mask); loss_mask is 1 on supervised (assistant) tokens."""

    def __init__(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor):
        assert input_ids.shape == loss_mask.shape and offsets[-1] == input_ids.numel()
        # int32 on the host (half of int64 for a billion-token set); collate widens per batch.
        self.input_ids = input_ids.to(torch.int32)
        self.loss_mask = loss_mask.to(torch.uint8)
        self.offsets = offsets.to(torch.int64)
        self.lengths = (self.offsets[1:] - self.offsets[:-1]).numpy()

    @classmethod
    def from_samples(cls, samples: list[tuple[Sequence[int], Sequence[int]]]) -> TokenDataset:
        """From (ids, mask) pairs (lists or arrays), concatenated by numpy, not Python lists."""
        lengths = np.fromiter((len(ids) for ids, _ in samples), dtype=np.int64, count=len(samples))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.concatenate([np.asarray(s, dtype=np.int32) for s, _ in samples] or [np.zeros(0, np.int32)])
        mask = np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in samples] or [np.zeros(0, np.uint8)])
        return cls(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(offsets))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.input_ids[start:end], self.loss_mask[start:end]

    def save(self, path: Path) -> None:
        """Atomic: a crash mid-write never leaves a truncated cache behind."""
        # Per-process temp name: several ranks may build the same cache at once.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(
            {
                "input_ids": self.input_ids,
                "loss_mask": self.loss_mask,
                "offsets": self.offsets,
            },
            str(tmp),
        )
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> TokenDataset:
        tensors = load_file(str(path))
        return cls(tensors["input_ids"], tensors["loss_mask"], tensors["offsets"])
