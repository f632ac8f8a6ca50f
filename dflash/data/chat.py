"""Render a conversation with the target's chat template; supervise the assistant tokens only.

The whole conversation is rendered once (`apply_chat_template`, as the target saw such text in
its own training) and tokenized with character offsets. Each assistant message's span in the
rendered text comes from the template itself, never from searching for its text: the
conversation is rendered again with an invisible sentinel inserted before (then after) that
message's content, and the rendering must be the original one with the sentinel inserted at a
single place, which is where the template put the content's start (end). A template that trims
replies, injects a system prompt or adds thinking tags moves the boundaries with it; a reply that
also appears in a user turn, or a one-character reply, is found where the template wrote it. The
supervised span is that content plus the template's end-of-turn marker (e.g. `<|im_end|>`),
because the target writes the marker to end its turn and the drafter must predict it. Everything
else (system and user turns, role headers, template scaffolding such as Qwen3's empty think
block) is context: loss mask 0.

The end-of-turn marker is read off the template itself: a probe conversation is rendered and
whatever follows the probe's assistant content (whitespace stripped) is the marker.

A template that rewrites the assistant content (the sentinel does not come back at one place)
fails the record with a reason instead of guessing a mask. Such templates (e.g. ones that strip
earlier turns' reasoning) can mark the supervised text themselves with transformers'
`{% generation %}` ... `{% endgeneration %}` blocks: when a template has them, its own assistant
mask is used.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from dflash.config.schema import TargetConfig
from dflash.data.conversations import MalformedRecord
from dflash.target.tokenizer import load_tokenizer

_PROBE_USER = "dflash-probe-user-7c1e"
_PROBE_ASSISTANT = "dflash-probe-assistant-7c1e"
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")
# Inserted into one assistant content to see where the template writes it: an invisible
# separator (U+2063, not whitespace: `trim` keeps it), in no tokenizer's text.
_SENTINEL = "\u2063dflash\u2063"


def template_file(tokenizer: Any) -> str:
    """Where the tokenizer's chat template was read from (transformers reads chat_template.jinja
    before tokenizer_config.json's chat_template)."""
    directory = Path(getattr(tokenizer, "name_or_path", "") or ".")
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        if (directory / name).is_file():
            return str(directory / name)
    return f"the chat template of {directory}"


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
        from jinja2 import TemplateSyntaxError

        try:
            probe = self.render_text(
                [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
            )
        except TemplateSyntaxError as exc:
            raise ValueError(
                f"{template_file(tokenizer)}: the chat template does not parse (line {exc.lineno}: {exc.message})"
            ) from exc
        if _PROBE_ASSISTANT not in probe:
            if not self.template_marks_replies:
                raise ValueError(
                    f"the chat template of {getattr(tokenizer, 'name_or_path', '?')!r} rewrites assistant "
                    "content (a probe reply does not come back verbatim), so no reply can be located for the "
                    "loss mask; mark the replies in the template with {% generation %} ... {% endgeneration %}"
                )
            self.end_of_turn = ""
        else:
            self.end_of_turn = probe[probe.index(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT) :].strip()

    def render_text(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` followed by the header of the assistant's reply."""
        text = self.render_text(messages, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _boundary(self, text: str, messages: list[dict[str, str]], index: int, *, after: bool) -> int | None:
        """Where the template writes the start (after=False) or the end of messages[index]'s
        content in `text` (the rendering of `messages`): the one place a sentinel added to that
        content alone comes back; None when it does not come back at one place."""
        # At the edge of the stripped content: a template that trims the reply keeps the sentinel.
        content = messages[index]["content"]
        body = content.strip()
        lead, trail = content[: content.index(body)], content[content.index(body) + len(body) :]
        marked_content = lead + body + _SENTINEL + trail if after else lead + _SENTINEL + body + trail
        marked = dict(messages[index], content=marked_content)
        variant = self.render_text([*messages[:index], marked, *messages[index + 1 :]])
        position = next((i for i, (a, b) in enumerate(zip(text, variant)) if a != b), len(text))
        if variant != text[:position] + _SENTINEL + text[position:]:
            return None
        return position

    def assistant_spans(self, text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]]:
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or not message["content"].strip():
                continue  # an empty reply supervises nothing
            start = self._boundary(text, messages, index, after=False)
            end = self._boundary(text, messages, index, after=True)
            if start is None or end is None or end <= start:
                raise MalformedRecord(
                    f"messages[{index}]: the chat template rewrites this assistant content "
                    "(an insertion into it does not come back at one place in the rendered text)"
                )
            # A template that keeps the reply's outer whitespace: it is part of the reply.
            content = message["content"]
            lead, trail = content[: len(content) - len(content.lstrip())], content[len(content.rstrip()) :]
            if lead and text[:start].endswith(lead):
                start -= len(lead)
            if trail and text.startswith(trail, end):
                end += len(trail)
            if self.end_of_turn and text.startswith(self.end_of_turn, end):
                end += len(self.end_of_turn)
            spans.append((start, end))
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
