"""Where regenerated replies come from: the target in this process, or an OpenAI-compatible
server (vLLM, SGLang, ...) serving it.

A backend maps a list of prompts (message lists ending with a user turn) to one reply each, or
to None for a prompt that failed for good (HTTP errors after every retry); the caller leaves
that conversation out of the output so that the next run retries it.

In process, a full-attention target decodes with continuous batching on static caches and
CUDA graphs (dflash.decoding.continuous): prompts are submitted one by one (`submit`) and
replies collected as they finish (`poll`). Other targets (hybrid linear attention) keep
transformers' `generate` over batches.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dflash.config.schema import SamplingConfig
from dflash.data.chat import ChatRenderer
from dflash.decoding.continuous import ContinuousBatcher
from dflash.decoding.sampling import Sampler
from dflash.decoding.static_target import static_decoding_refusal
from dflash.target.model import FrozenTarget

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]


@dataclass
class Reply:
    text: str
    finish_reason: str  # "stop" (end of turn) or "length" (hit sampling.max_new_tokens)
    tokens: int = 0  # generated tokens (0: the backend does not say)


class RegenBackend(Protocol):
    name: str
    # True: conversations are sent one by one from many threads (a server batches them itself);
    # False: the caller batches conversations into each generate() call.
    conversations_in_flight: bool

    def describe(self) -> str:
        """The sampling settings in effect, for the log and the output records."""

    def generate(self, prompts: list[Messages]) -> list[Reply | None]: ...


class TransformersBackend:
    """The target in this process: continuous batching over `slots` static-cache slots of
    `max_len` positions (prompt + reply) when the target allows it (`continuous`), else batched
    `generate` (left-padded prompts, the target's masked attention)."""

    name = "transformers"
    conversations_in_flight = False

    def __init__(
        self,
        target: FrozenTarget,
        renderer: ChatRenderer,
        sampling: SamplingConfig,
        *,
        slots: int = 16,
        max_len: int = 4096,
        graphs: bool | None = None,
        compile: bool = False,
    ):
        self.target, self.renderer, self.sampling = target, renderer, sampling
        tokenizer = renderer.tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.generator_seed = sampling.seed
        self.calls = 0
        self.max_len = max_len
        self.batcher: ContinuousBatcher | None = None
        refusal = static_decoding_refusal(target)
        if refusal is not None:
            log.info("regen: transformers generate() batches (no static cache: %s)", refusal)
            return
        try:
            self.batcher = ContinuousBatcher(
                target,
                slots=slots,
                max_len=max_len,
                max_new_tokens=sampling.max_new_tokens,
                stop_ids=frozenset([self.eos_id]),
                sampler=Sampler(self.generate_options(), target.device, sampling.seed),
                graphs=graphs,
                compile=compile,
            )
        except torch.OutOfMemoryError as exc:
            raise ValueError(
                f"regen: the static KV cache for batch_size={slots} slots x max_len={max_len} positions "
                f"does not fit on {target.device}; lower batch_size or max_len ({exc})"
            ) from exc

    @property
    def continuous(self) -> bool:
        return self.batcher is not None

    def submit(self, tag: Any, messages: Messages) -> bool:
        """Queue one prompt (continuous mode); False: it cannot be generated (the chat template
        refuses it, or prompt + sampling.max_new_tokens exceeds max_len), a failed reply."""
        ids = self._encode(messages)
        if ids is None:
            return False
        if not self.batcher.fits(len(ids)):
            log.warning(
                "regen: a %d-token prompt + sampling.max_new_tokens=%d exceeds max_len=%d; left out "
                "(raise max_len to include it)",
                len(ids),
                self.sampling.max_new_tokens,
                self.max_len,
            )
            return False
        self.batcher.submit(tag, ids)
        return True

    def poll(self) -> list[tuple[Any, Reply]]:
        """One batcher step: the replies that finished in it, with the tags they were sent with."""
        return [(done.tag, self._reply(done.tokens, done.finish_reason)) for done in self.batcher.step()]

    def _reply(self, tokens: list[int], finish_reason: str) -> Reply:
        text = self.renderer.tokenizer.decode(tokens, skip_special_tokens=True)
        return Reply(text, finish_reason, len(tokens))

    def generate_options(self) -> dict[str, float | int | bool]:
        """`sampling` over the target's generation_config.json: what generate() will use."""
        recommended = self.target.model.generation_config
        sampling = self.sampling
        if sampling.temperature is not None:
            do_sample = sampling.temperature > 0
        else:
            do_sample = bool(recommended.do_sample)
        if not do_sample:
            return {"do_sample": False}

        def pick(name: str):
            value = getattr(sampling, name)
            return value if value is not None else getattr(recommended, name)

        return {
            "do_sample": True,
            "temperature": pick("temperature"),
            "top_p": pick("top_p"),
            "top_k": pick("top_k"),
        }

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.generate_options().items())

    def _encode(self, messages: Messages) -> list[int] | None:
        from jinja2 import TemplateError

        try:
            return self.renderer.prompt_ids(messages)
        except TemplateError as exc:
            log.warning("regen: the chat template refuses a conversation (%s); left out", exc)
            return None

    @torch.no_grad()
    def generate(self, prompts: list[Messages]) -> list[Reply | None]:
        maybe = [self._encode(messages) for messages in prompts]
        rows = [i for i, ids in enumerate(maybe) if ids is not None]
        replies: list[Reply | None] = [None] * len(prompts)
        if rows:
            for row, reply in zip(rows, self._generate([maybe[i] for i in rows])):
                replies[row] = reply
        return replies

    def _generate(self, encoded: list[list[int]]) -> list[Reply]:
        options = self.generate_options()
        if options["do_sample"]:
            torch.manual_seed(self.generator_seed + self.calls)  # reproducible batch by batch
        self.calls += 1
        generated = self.target.generate(
            encoded,
            pad_id=self.pad_id,
            max_new_tokens=self.sampling.max_new_tokens,
            eos_token_id=self.eos_id,
            **options,
        )
        replies = []
        for row in generated:
            finish = "length"
            if self.eos_id in row:
                row, finish = row[: row.index(self.eos_id)], "stop"
            replies.append(self._reply(row, finish))
        return replies


def answer_problem(response: Any) -> str | None:
    """Why a chat-completions answer holds no usable reply, or None when it does."""
    choices = getattr(response, "choices", None)
    if not isinstance(choices, list):
        return f"not a chat completion: {str(response)[:80]!r}"
    if not choices:
        return "no choices"
    content = getattr(getattr(choices[0], "message", None), "content", None)
    if not isinstance(content, str):
        return f"message content is {content!r}"
    if not content.strip():
        return "an empty message"
    return None


class HttpBackend:
    """An OpenAI-compatible chat-completions endpoint (thread-safe; one request per call).

    Retries (connection errors, timeouts, 408/409/429/5xx, with exponential backoff) are the
    `openai` client's; `max_retries` and `timeout_s` are passed to it.
    """

    name = "http"
    conversations_in_flight = True

    def __init__(
        self,
        *,
        url: str,
        model: str | None,
        api_key: str,
        sampling: SamplingConfig,
        concurrency: int,
        timeout_s: float,
        max_retries: int,
        chat_template_kwargs: dict | None = None,
    ):
        import openai

        self.client = openai.OpenAI(base_url=url, api_key=api_key, timeout=timeout_s, max_retries=max_retries)
        self.url, self.sampling, self.concurrency = url, sampling, concurrency
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        try:
            self.model = model or self.client.models.list().data[0].id
        except (openai.OpenAIError, IndexError) as exc:
            raise ValueError(f"regen.url={url!r}: cannot list the served models ({exc})") from exc

    def _one(self, messages: Messages) -> Reply | None:
        """One reply, or None (a counted failure) for a request that failed after the client's
        retries or an answer that holds no reply: no `choices`, a body that is not a
        chat-completion (an HTML error page behind a proxy), a null or empty content."""
        import openai

        try:
            response = self.client.chat.completions.create(
                model=self.model, messages=messages, **self.request_options()
            )
        except (openai.OpenAIError, ValueError, TypeError, KeyError) as exc:
            # ValueError & co: a body the client could not parse (invalid JSON behind a 200).
            log.warning(
                "regen: request to %s failed after retries: %s: %s", self.url, type(exc).__name__, exc
            )
            return None
        problem = answer_problem(response)
        if problem is not None:
            log.warning("regen: %s answered without a reply (%s); counted as failed", self.url, problem)
            return None
        choice = response.choices[0]
        usage = getattr(response, "usage", None)
        tokens = getattr(usage, "completion_tokens", None) or 0
        return Reply(
            choice.message.content, choice.finish_reason or "stop", tokens if isinstance(tokens, int) else 0
        )

    def request_options(self) -> dict:
        """Sampling fields left null are not sent: the server applies the model's defaults."""
        sampling = self.sampling
        options: dict = {"max_tokens": sampling.max_new_tokens, "seed": sampling.seed}
        if sampling.temperature is not None:
            options["temperature"] = sampling.temperature
        if sampling.top_p is not None:
            options["top_p"] = sampling.top_p
        extra = {}  # vLLM / SGLang extensions of the chat-completions request
        if sampling.top_k is not None:
            extra["top_k"] = sampling.top_k
        if self.chat_template_kwargs:
            extra["chat_template_kwargs"] = self.chat_template_kwargs
        if extra:
            options["extra_body"] = extra
        return options

    def describe(self) -> str:
        shown = {k: v for k, v in self.request_options().items() if k != "extra_body"}
        if self.sampling.top_k is not None:
            shown["top_k"] = self.sampling.top_k
        return " ".join(f"{k}={v}" for k, v in shown.items()) + " (unset fields: the server's defaults)"

    def generate(self, prompts: list[Messages]) -> list[Reply | None]:
        if len(prompts) == 1:
            return [self._one(prompts[0])]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(self._one, prompts))
