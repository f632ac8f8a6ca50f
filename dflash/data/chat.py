"""Render a conversation with the target's chat template; supervise the assistant tokens only.

The whole conversation is rendered once (`apply_chat_template`, as the target saw such text in
its own training) and tokenized with character offsets. Each assistant message's content is
located in the rendered text, in order; the supervised span is that content plus the
template's end-of-turn marker (e.g. `<|im_end|>`), because the target writes the marker to end
its turn and the drafter must predict it. Everything else (system and user turns, role
headers, template scaffolding such as Qwen3's empty think block) is context: loss mask 0.

The end-of-turn marker is read off the template itself: a probe conversation is rendered and
whatever follows the probe's assistant content (whitespace stripped) is the marker.

A template that rewrites the assistant content (so it cannot be found verbatim) fails the
record with a reason instead of guessing a mask. Such templates (e.g. ones that strip earlier
turns' reasoning) can mark the supervised text themselves with transformers' `{% generation %}`
... `{% endgeneration %}` blocks: when a template has them, its own assistant mask is used.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from dflash.config.schema import TargetConfig
from dflash.data.conversations import MalformedRecord
from dflash.models.tokenizer import load_tokenizer

_PROBE_USER = "dflash-probe-user-7c1e"
_PROBE_ASSISTANT = "dflash-probe-assistant-7c1e"
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatRenderer:
    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer at {getattr(tokenizer, 'name_or_path', '?')!r} has no chat_template; "
                "conversation data needs one (set target.tokenizer to a directory whose "
                "tokenizer_config.json or chat_template.jinja has it)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("conversation data needs a fast tokenizer (character offsets for the loss mask)")
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.template_marks_replies = bool(_GENERATION_BLOCK.search(tokenizer.chat_template))
        probe = self.render_text(
            [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        )
        self.end_of_turn = probe[probe.index(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT) :].strip()

    def render_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` followed by the header of the assistant's reply."""
        text = self.render_text(messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def assistant_spans(self, text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]]:
        spans, cursor = [], 0
        for index, message in enumerate(messages):
            content = message["content"]
            start = text.find(content, cursor) if content else -1
            if message["role"] != "assistant":
                if start >= 0:
                    cursor = start + len(content)
                continue
            if start < 0 and content.strip():
                content = content.strip()  # templates commonly strip the reply
                start = text.find(content, cursor)
            if start < 0:
                if not content.strip():
                    continue  # an empty reply supervises nothing
                raise MalformedRecord(
                    f"messages[{index}]: the chat template rewrites this assistant content "
                    "(not found verbatim in the rendered text)"
                )
            end = start + len(content)
            if self.end_of_turn and text.startswith(self.end_of_turn, end):
                end += len(self.end_of_turn)
            spans.append((start, end))
            cursor = end
        return spans

    def tokenize(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask): mask 1 on tokens that start inside an assistant span.
        MalformedRecord if the template refuses the conversation (e.g. roles that do not
        alternate) or rewrites a reply."""
        from jinja2 import TemplateError

        try:
            return self._tokenize(messages)
        except TemplateError as exc:
            raise MalformedRecord(f"the chat template refuses this conversation: {exc}") from exc

    def _tokenize(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        if self.template_marks_replies:
            out = self.tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **self.template_kwargs,
            )
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        text = self.render_text(messages)
        spans = self.assistant_spans(text, messages)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = []
        for token_start, _ in encoded["offset_mapping"]:
            mask.append(int(any(start <= token_start < end for start, end in spans)))
        return encoded["input_ids"], mask

    def fingerprint(self) -> str:
        """Changes whenever tokenization or rendering could: vocabulary, merges, normalizer,
        special tokens, the chat template and its variables."""
        payload = {
            "tokenizer": self.tokenizer.backend_tokenizer.to_str(),
            "template": self.tokenizer.chat_template,
            "template_kwargs": self.template_kwargs,
            "special": {k: str(v) for k, v in sorted(self.tokenizer.special_tokens_map.items())},
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load_chat_renderer(cfg: TargetConfig, needed_for: str) -> ChatRenderer:
    """The target's tokenizer with its chat template and `target.chat_template_kwargs`."""
    return ChatRenderer(load_tokenizer(cfg, needed_for), dict(cfg.chat_template_kwargs))
