"""Training text the target writes itself: random prompts continued greedily by the target.

DFlash trains on target-generated responses; for the tiny random-init target this is the only
text there is. Prompts are context (loss_mask 0), the continuation is supervised (loss_mask 1).
The set is cached on disk, keyed by the target, the data config and the seed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from dflash.config.schema import PACKING_KEYS, DataConfig, SyntheticText, TargetConfig
from dflash.data.dataset import TokenDataset
from dflash.target.model import FrozenTarget

log = logging.getLogger(__name__)


def cache_key(target_cfg: TargetConfig, data_cfg: DataConfig, excluded_token_ids: list[int]) -> str:
    payload = {
        "target": OmegaConf.to_container(OmegaConf.structured(target_cfg), resolve=True, enum_to_str=True),
        "data": OmegaConf.to_container(OmegaConf.structured(data_cfg), resolve=True, enum_to_str=True),
        "excluded": sorted(excluded_token_ids),
    }
    for key in ("name",):  # renaming an option does not change the text it produces
        payload["target"].pop(key, None)
        payload["data"].pop(key, None)
    for key in PACKING_KEYS:  # nor does packing it into batches another way
        payload["data"].pop(key, None)
    payload["target"].pop("compile", None)  # nor does compiling the target's training forward
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def allowed_tokens(vocab_size: int, excluded: list[int]) -> np.ndarray:
    return np.setdiff1d(np.arange(vocab_size), np.asarray(excluded, dtype=np.int64))


def random_prompts(
    num: int, length_min: int, length_max: int, vocab_size: int, excluded: list[int], rng: np.random.Generator
) -> list[np.ndarray]:
    allowed = allowed_tokens(vocab_size, excluded)
    lengths = rng.integers(length_min, length_max + 1, size=num)
    return [rng.choice(allowed, size=int(n)) for n in lengths]


def greedy_continue(target: FrozenTarget, prompts: list[np.ndarray], num_new: int) -> list[list[int]]:
    """Greedy continuations of exactly `num_new` tokens each (no end of sequence)."""
    return target.generate(
        prompts, pad_id=0, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, eos_token_id=None
    )


def generate_dataset(target: FrozenTarget, cfg: DataConfig, excluded_token_ids: list[int]) -> TokenDataset:
    rng = np.random.default_rng(cfg.seed)
    vocab_size = target.config.vocab_size
    prompts = random_prompts(
        cfg.num_samples, cfg.prompt_len_min, cfg.prompt_len_max, vocab_size, excluded_token_ids, rng
    )
    gen_lengths = rng.integers(cfg.gen_len_min, cfg.gen_len_max + 1, size=cfg.num_samples)
    if SyntheticText(cfg.continuation) is SyntheticText.random:
        allowed = allowed_tokens(vocab_size, excluded_token_ids)
        texts = np.random.default_rng([cfg.seed, 1])  # apart from `rng`: the prompts match greedy data
        return TokenDataset.from_samples(
            [
                (
                    (prompt.tolist() + texts.choice(allowed, size=int(n)).tolist())[: cfg.max_length],
                    ([0] * len(prompt) + [1] * int(n))[: cfg.max_length],
                )
                for prompt, n in zip(prompts, gen_lengths)
            ]
        )
    samples: list[tuple[list[int], list[int]]] = [([], [])] * cfg.num_samples
    # Similar prompt lengths batch together (little padding). A greedy continuation is prefix-
    # consistent, so each sample is cut to its own length from its batch's longest.
    order = np.argsort([len(p) for p in prompts], kind="stable")
    for start in range(0, cfg.num_samples, cfg.generation_batch_size):
        chunk = order[start : start + cfg.generation_batch_size]
        continuations = greedy_continue(target, [prompts[i] for i in chunk], int(gen_lengths[chunk].max()))
        for index, continuation in zip(chunk, continuations):
            prompt = prompts[index].tolist()
            response = continuation[: gen_lengths[index]]
            samples[index] = (
                (prompt + response)[: cfg.max_length],
                ([0] * len(prompt) + [1] * len(response))[: cfg.max_length],
            )
    return TokenDataset.from_samples(samples)


def load_or_generate(
    target: FrozenTarget,
    target_cfg: TargetConfig,
    cfg: DataConfig,
    cache_dir: Path,
    excluded_token_ids: list[int],
) -> TokenDataset:
    path = (
        Path(cache_dir)
        / "synthetic"
        / f"{cfg.name}-{cache_key(target_cfg, cfg, excluded_token_ids)}.safetensors"
    )
    if path.exists():
        log.info("data: reusing %s", path)
        return TokenDataset.load(path)
    log.info("data: generating %d samples with the target -> %s", cfg.num_samples, path)
    dataset = generate_dataset(target, cfg, excluded_token_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset.save(path)
    return dataset
