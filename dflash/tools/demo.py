"""`dflash demo DIR`: files to try the real-data commands on, built here, nothing downloaded: a
small BPE tokenizer trained on generated text, with a ChatML chat template, saved with a random
Qwen3 target (DIR/target), and conversation files in both shapes users have (DIR/chat.jsonl:
ShareGPT; DIR/heldout.jsonl: OpenAI messages, for evaluation).

    dflash demo /tmp/demo
    dflash regen target=hf target.path=/tmp/demo/target input=[/tmp/demo/chat.jsonl] output=/tmp/demo/regen.jsonl

The tests build their checkpoints from the same pieces (tests/tiny_assets.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from dflash.tools.arguments import command_parser

# The tiny target's architecture (conf/target/tiny.yaml uses the same numbers).
TINY_ARCH = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    max_position_embeddings=512,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light"
).split()


def sentence(rng: random.Random, low: int = 4, high: int = 14) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(sentences))


def build_tokenizer(directory: Path, vocab_size: int = 480):
    """A BPE tokenizer (Metaspace pre-tokenization: decoding is lossless) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [paragraph(rng, 3) for _ in range(3000)]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    backend.decoder = decoders.Metaspace(prepend_scheme="never")
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "▁"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet)
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def write_conversations(path: Path, count: int, shape: str = "openai", seed: int = 0) -> Path:
    """`count` conversations of 1-2 user turns; shape 'openai' (messages) or 'sharegpt'."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for index in range(count):
            turns = []
            if rng.random() < 0.3:
                turns.append(("system", "You are a helpful assistant."))
            for _ in range(rng.randint(1, 2)):
                turns.append(("user", paragraph(rng, rng.randint(1, 2))))
                turns.append(("assistant", paragraph(rng, rng.randint(1, 3))))
            if shape == "openai":
                record = {"id": index, "messages": [{"role": r, "content": c} for r, c in turns]}
            else:
                names = {"system": "system", "user": "human", "assistant": "gpt"}
                record = {"id": index, "conversations": [{"from": names[r], "value": c} for r, c in turns]}
            handle.write(json.dumps(record) + "\n")
    return path


def save_demo_target(directory: Path, **arch: int) -> Path:
    """A random-init Qwen3 checkpoint (TINY_ARCH, fields in `arch` replaced) and its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **{**TINY_ARCH, **arch})).save_pretrained(
        directory
    )
    build_tokenizer(directory)
    return directory


def architecture_fields(parser, items: list[str]) -> dict[str, int]:
    """`--arch hidden_size=1024 ...` as Qwen3 config fields; a malformed one is a usage error."""
    fields = {}
    for item in items:
        key, _, value = item.partition("=")
        if not key or not value.isdigit():
            parser.error(f"--arch {item}: give FIELD=INTEGER, e.g. hidden_size=1024")
        fields[key] = int(value)
    return fields


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("demo", __doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--conversations", type=int, default=600, help="ShareGPT conversations to write")
    parser.add_argument("--heldout", type=int, default=16, help="held-out prompts to write")
    parser.add_argument("--arch", nargs="*", default=[], help="Qwen3 config fields, e.g. hidden_size=1024")
    args = parser.parse_args(argv)
    arch = architecture_fields(parser, args.arch)
    args.directory.mkdir(parents=True, exist_ok=True)
    save_demo_target(args.directory / "target", **arch)
    write_conversations(args.directory / "chat.jsonl", args.conversations, "sharegpt", seed=11)
    write_conversations(args.directory / "heldout.jsonl", args.heldout, "openai", seed=99)
    print(
        f"dflash demo: wrote {args.directory}/target, chat.jsonl ({args.conversations}), heldout.jsonl ({args.heldout})"
    )


if __name__ == "__main__":
    main()
