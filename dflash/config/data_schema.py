"""The data's config group (`data`): which samples exist and how they are packed into batches.

No torch here: see dflash/config/schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING


class SyntheticText(str, Enum):
    greedy = "greedy"  # the target continues each prompt greedily: text a drafter can learn
    random = "random"  # uniformly random tokens, no target call: throughput runs at scale


class DataKind(str, Enum):
    synthetic = "synthetic"
    conversations = "conversations"


@dataclass
class ConversationLayoutConfig:
    """Where conversation records keep their turns (data.layout, regen's layout). null: auto —
    `messages` with role/content turns (OpenAI), else `conversations` with from/value (ShareGPT)."""

    # The record field (a file's key, a Parquet or datasets column) holding the list of turns.
    field: Optional[str] = None
    # Each turn's role key (its values: system, user/human, assistant/gpt/model) and text key;
    # null: role/content when a turn has `role`, else from/value.
    role: Optional[str] = None
    content: Optional[str] = None


@dataclass
class DataConfig:
    name: str = MISSING
    kind: DataKind = DataKind.synthetic
    # Samples longer than this are truncated (both kinds).
    max_length: int = 3072
    # conversations: local .jsonl / .json / .parquet files, or directories `datasets`' save_to_disk
    # wrote, of OpenAI `messages` (role/content) or ShareGPT `conversations` (from/value) records
    # (other names: `layout`), rendered with the target's chat template.
    files: list[str] = field(default_factory=list)
    layout: ConversationLayoutConfig = field(default_factory=ConversationLayoutConfig)
    # conversations: samples with fewer supervised (assistant) tokens are dropped and counted.
    min_supervised_tokens: int = 16
    # conversations: tokenizer processes (datasets.map num_proc); null: in this process.
    num_proc: Optional[int] = None
    # Samples held out of training (chosen by `seed`): val/loss, val/acc, val/tau_sim,
    # val/tau_block and val/tau_decode (the one to set beside decoding's tau) measure the drafter
    # on them at every periodic evaluation and at the end.
    # 0: no validation split.
    val_samples: int = 0
    # synthetic: random prompts continued greedily by the target.
    num_samples: int = 1024
    prompt_len_min: int = 8
    prompt_len_max: int = 48
    gen_len_min: int = 16
    gen_len_max: int = 80
    seed: int = 0
    # Samples generated per target forward while building the synthetic set.
    generation_batch_size: int = 64
    # synthetic: how the supervised part is written (random: for speed runs of large targets,
    # whose greedy text takes hours to write; nothing there can be learned).
    continuation: SyntheticText = SyntheticText.greedy
    # How the samples are packed into batches, set by each data option beside its max_length
    # (the batch order is the `scheduler` group's). Upper bounds (exclusive, the last inclusive)
    # of the length buckets:
    bucket_edges: list[int] = MISSING
    # Padded tokens (batch_size * longest sample) a batch may hold.
    tokens_per_batch: int = MISSING
    # Block tokens (batch_size * anchors of its widest sample * block_size) a batch may hold:
    # what the drafter computes and keeps for backward. null: no limit beyond tokens_per_batch.
    block_tokens_per_batch: Optional[int] = None


# The data keys that say how samples are packed, not which samples exist (a data cache ignores them).
PACKING_KEYS = ("bucket_edges", "tokens_per_batch", "block_tokens_per_batch")
