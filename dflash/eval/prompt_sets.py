"""Evaluation prompt sets: benchmark files (local JSONL, also .gz / .zst, or `package:<name>` for a
file an installed package ships), rendered with the target's chat template, or random held-out
token prompts for a target without a tokenizer.

A line holds {"prompt": "..."} (one user turn), {"turns": [...]} (its first turn is used), or a
conversation in either training shape, cut before its first reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateError

from dflash.config.schema import EvalConfig
from dflash.data.benchmarks import is_packaged, packaged_prompts
from dflash.data.conversations import MalformedRecord, normalize
from dflash.data.files import lines, record_file
from dflash.data.synthetic import random_prompts

RANDOM_SET = "heldout"


@dataclass
class PromptSet:
    name: str
    prompts: list[list[int]]
    # Decoding of a prompt ends at any of these (the tokenizer's end of turn); with the target's
    # generation_config eos ids added at evaluation.
    stop_ids: frozenset[int] = frozenset()


def read_prompt_file(name: str, path: str, renderer: Any, limit: int) -> PromptSet:
    """The first `limit` prompts of a JSONL benchmark file (or .jsonl.gz, or `package:<name>`
    for a file shipped in an installed package), as chat-template token ids."""
    template = "{prompt}"
    if is_packaged(path):
        located, template = packaged_prompts(f"eval.benchmarks.{name}", path)
        path = str(located)
    if not Path(path).is_file():
        raise ValueError(f"eval.benchmarks.{name}: {path} is not a file")
    source = record_file(Path(path))
    if source is None or source.kind != "jsonl":
        raise ValueError(
            f"eval.benchmarks.{name}: {path} is not a JSON Lines file (.jsonl, .jsonl.gz, .jsonl.zst)"
        )
    prompts = []
    for line_no, line in lines(source):
        if len(prompts) == limit:
            break
        try:
            record = json.loads(line.decode("utf-8"))
            if isinstance(record, dict) and ("prompt" in record or "turns" in record):
                text = record["prompt"] if "prompt" in record else record["turns"][0]
                if not isinstance(text, str) or not text.strip():
                    raise MalformedRecord(f"the prompt is {text!r}, not a non-empty string")
                messages = [{"role": "user", "content": template.format(prompt=text)}]
            else:  # a conversation (OpenAI or ShareGPT): everything before its first reply
                messages = []
                for message in normalize(record, need_reply=False)[0]:
                    if message["role"] == "assistant":
                        break
                    messages.append(message)
                if not messages or messages[-1]["role"] != "user":
                    raise MalformedRecord("no user turn before the first reply")
            prompts.append(renderer.prompt_ids(messages))
        except (
            json.JSONDecodeError,
            UnicodeDecodeError,
            MalformedRecord,
            TemplateError,
            KeyError,
            IndexError,
            TypeError,
        ) as exc:
            raise ValueError(
                f"eval.benchmarks.{name}: {path}:{line_no}: expected {{'prompt': str}}, "
                f"{{'turns': [...]}} or a conversation ({type(exc).__name__}: {exc})"
            ) from exc
    if not prompts:
        raise ValueError(f"eval.benchmarks.{name}: {path} holds no prompt")
    eos = renderer.tokenizer.eos_token_id
    return PromptSet(name, prompts, frozenset() if eos is None else frozenset([eos]))


def load_prompt_sets(
    cfg: EvalConfig, renderer_factory: Callable[[], Any], vocab_size: int, excluded: list[int], limit: int
) -> list[PromptSet]:
    if cfg.benchmarks:
        renderer = renderer_factory()
        return [read_prompt_file(n, p, renderer, limit) for n, p in sorted(cfg.benchmarks.items())]
    rng = np.random.default_rng(cfg.seed)
    prompts = random_prompts(limit, cfg.prompt_len, cfg.prompt_len, vocab_size, excluded, rng)
    return [PromptSet(RANDOM_SET, [p.tolist() for p in prompts])]
