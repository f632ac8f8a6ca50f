"""Next tokens from logits on the device: greedy, or temperature / top-k / top-p sampling with
a seeded generator (generate()'s semantics: top_k 0 and top_p 1.0 switch a filter off)."""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, options: dict, device: torch.device, seed: int):
        self.sample = bool(options.get("do_sample", False))
        self.temperature = float(options.get("temperature") or 1.0)
        self.top_k = int(options.get("top_k") or 0)
        self.top_p = float(options.get("top_p") if options.get("top_p") is not None else 1.0)
        self.generator = None
        if self.sample:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def __call__(self, logits_NV: torch.Tensor) -> torch.Tensor:
        """Token ids [N] (on the logits' device)."""
        if not self.sample:
            return logits_NV.argmax(-1)
        logits = logits_NV.float() / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            ordered, order = torch.sort(logits, dim=-1, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = (probs.cumsum(-1) - probs) >= self.top_p
            logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
