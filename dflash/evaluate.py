"""Speculative decoding of held-out prompts: mean acceptance length and the lossless check."""

from __future__ import annotations

import numpy as np

from dflash.config.schema import EvalConfig
from dflash.data.synthetic import random_prompts
from dflash.models.drafter import DFlashDrafter
from dflash.models.target import FrozenTarget
from dflash.spec_decode import greedy_generate, speculative_generate


def evaluate_spec_decode(
    target: FrozenTarget, drafter: DFlashDrafter, cfg: EvalConfig, excluded_token_ids: list[int]
) -> dict[str, float]:
    rng = np.random.default_rng(cfg.seed)
    prompts = random_prompts(
        cfg.num_prompts, cfg.prompt_len, cfg.prompt_len, target.config.vocab_size, excluded_token_ids, rng
    )
    was_training = drafter.training
    drafter.eval()
    lengths: list[int] = []
    identical = 0
    for prompt in prompts:
        result = speculative_generate(target, drafter, prompt.tolist(), cfg.max_new_tokens)
        reference = greedy_generate(target, prompt.tolist(), cfg.max_new_tokens)
        identical += result.output_ids == reference
        lengths += result.acceptance_lengths
    drafter.train(was_training)
    histogram = np.bincount(lengths, minlength=drafter.block_size + 1)
    metrics = {
        "eval/tau": float(np.mean(lengths)),
        "eval/lossless_frac": identical / len(prompts),
        "eval/num_prompts": float(len(prompts)),
    }
    metrics.update(
        {f"eval/accept_len_{k}_frac": histogram[k] / len(lengths) for k in range(1, len(histogram))}
    )
    return metrics
