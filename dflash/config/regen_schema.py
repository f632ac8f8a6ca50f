"""`dflash-regen`'s root config (conf/regen.yaml) and its sampling settings.

No torch here: see dflash/config/schema.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING

from dflash.config.data_schema import ConversationLayoutConfig
from dflash.config.run_schema import PathsConfig
from dflash.config.target_schema import TargetConfig


class RegenBackend(str, Enum):
    transformers = "transformers"
    http = "http"


@dataclass
class SamplingConfig:
    # null: the target's own recommendation (its generation_config.json; over HTTP, whatever the
    # server applies, e.g. vLLM's --generation-config). Temperature 0: greedy.
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_new_tokens: int = 2048
    seed: int = 0


@dataclass
class RegenConfig:
    """`dflash-regen` (conf/regen.yaml): replace the assistant turns of a dataset with the target's."""

    target: TargetConfig = field(default_factory=TargetConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    # Conversation files (.jsonl / .json / .parquet, or save_to_disk directories; OpenAI or ShareGPT
    # records, other names: `layout`).
    input: list[str] = MISSING
    layout: ConversationLayoutConfig = field(default_factory=ConversationLayoutConfig)
    # JSONL of regenerated conversations (OpenAI `messages`); appended to, so a rerun resumes.
    output: str = MISSING
    backend: RegenBackend = RegenBackend.transformers
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Replies generated at once (transformers: continuous-batching slots, or one generate batch
    # for targets without a static cache; http: conversations in flight, each on its own).
    batch_size: int = 16
    # transformers, static cache: positions per slot (prompt + reply); a longer prompt is left
    # out with a warning (a rerun with a larger max_len picks it up).
    max_len: int = 4096
    # transformers, static cache: decode steps replayed as CUDA graphs (null: on CUDA), their
    # kernels fused by torch.compile first (`compile`: a one-time compile per run).
    cuda_graphs: Optional[bool] = None
    compile: bool = False
    # http: OpenAI-compatible base URL (e.g. http://localhost:8000/v1), model name (null: the
    # first the server lists), API key (null: the OPENAI_API_KEY environment variable, else
    # "EMPTY"; masked as *** in every record), per-request timeout and retries (backoff,
    # 429/5xx/errors).
    url: Optional[str] = None
    model: Optional[str] = None
    api_key: Optional[str] = None
    timeout_s: float = 600.0
    max_retries: int = 5
    # Exit 2 (after writing what succeeded) when more than this share of the conversations
    # attempted failed: a dead or misconfigured server is an error, not a short dataset.
    max_failed_frac: float = 0.01
    # Stop after this many conversations (null: all).
    limit: Optional[int] = None
