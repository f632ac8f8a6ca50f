"""Conversation data: both record shapes, assistant-only masks against the template, malformed
records counted with their location, truncation and drops, and the tokenized cache."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from transformers import AutoTokenizer

from dflash.config.schema import DataConfig, DataKind
from dflash.data.chat import ChatRenderer
from dflash.data.conversations import MalformedRecord, SkipReport, normalize, read_conversations
from dflash.data.prepare import load_or_prepare, prepare
from tests.conftest import conversation_overrides
from tests.tiny_assets import write_conversations


@pytest.fixture(scope="module")
def renderer(tiny_chat_dir) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_chat_dir))


def data_cfg(files, **overrides) -> DataConfig:
    base = DataConfig(
        name="conversations",
        kind=DataKind.conversations,
        files=[str(f) for f in files],
        max_length=512,
        min_supervised_tokens=1,
    )
    return replace(base, **overrides)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the time?"},
    {"role": "assistant", "content": "The time is now."},
    {"role": "user", "content": "Why?"},
    {"role": "assistant", "content": "Because it is."},
]


def test_both_shapes_give_the_same_messages():
    openai = {"messages": CONVERSATION}
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in CONVERSATION]}
    assert normalize(openai)[0] == normalize(sharegpt)[0] == CONVERSATION
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "it?"}]}, {"role": "assistant", "content": "x"}]}  # fmt: skip
    assert normalize(parts)[0][0]["content"] == "What is it?"


def test_same_conversations_in_either_file_shape_tokenize_identically(tmp_path, renderer):
    openai = write_conversations(tmp_path / "a.jsonl", 12, "openai", seed=3)
    sharegpt = write_conversations(tmp_path / "b.jsonl", 12, "sharegpt", seed=3)
    a, _ = prepare(renderer, data_cfg([openai]))
    b, _ = prepare(renderer, data_cfg([sharegpt]))
    assert a.input_ids.tolist() == b.input_ids.tolist()
    assert a.loss_mask.tolist() == b.loss_mask.tolist()


def test_loss_mask_covers_exactly_the_assistant_replies_and_their_end_of_turn(renderer):
    tokenizer = renderer.tokenizer
    ids, mask = renderer.tokenize(CONVERSATION)
    assert renderer.end_of_turn == "<|im_end|>"
    # Token by token against the template: re-render and walk the supervised runs.
    runs, current = [], []
    for token, supervised in zip(ids, mask):
        if supervised:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    assert [tokenizer.decode(run) for run in runs] == [
        "The time is now.<|im_end|>",
        "Because it is.<|im_end|>",
    ]
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    for start in [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]:
        assert ids[start - len(header) : start] == header  # each run starts right after the header
    prompt_text = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "What is the time?" in prompt_text and "Be brief." in prompt_text  # context, unsupervised
    assert ids == tokenizer(renderer.render_text(CONVERSATION), add_special_tokens=False)["input_ids"]


def test_malformed_records_are_counted_with_file_and_line(tmp_path, renderer):
    path = tmp_path / "mixed.jsonl"

    def good(n: int) -> str:  # three different conversations (a repeat would count as a duplicate)
        return json.dumps(
            {"messages": [{"role": "system", "content": f"Be brief ({n})."}, *CONVERSATION[1:]]}
        )

    lines = [
        good(1),
        "{not json",
        good(2),
        json.dumps({"text": "no conversation field"}),
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        json.dumps({"conversations": [{"from": "human"}]}),
        good(3),
    ]
    path.write_text("\n".join(lines) + "\n")
    dataset, stats = prepare(renderer, data_cfg([path]))
    assert len(dataset) == 3 and stats.samples == 3
    assert stats.records == 8  # the blank line is not a record
    assert stats.skipped == {"invalid_json": 1, "malformed": 4}
    assert stats.skipped_examples[0].startswith(f"{path}:2: invalid JSON")
    assert f"{path}:5: messages[0]: unknown role 'wizard'" in stats.skipped_examples
    assert f"{path}:7: no assistant turn" in stats.skipped_examples


def test_truncation_and_too_few_supervised_tokens(tmp_path, renderer):
    path = tmp_path / "c.jsonl"
    short_reply = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go."}]}
    long_reply = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "word " * 200}]}  # fmt: skip
    path.write_text(json.dumps(short_reply) + "\n" + json.dumps(long_reply) + "\n")
    dataset, stats = prepare(renderer, data_cfg([path], max_length=64, min_supervised_tokens=5))
    assert len(dataset) == 1 and int(dataset.lengths[0]) == 64
    assert stats.truncated == 1
    assert stats.skipped == {"too_few_supervised": 1}
    assert (
        "data.min_supervised_tokens=5" in stats.skipped_examples[0]
        and f"{path}:1" in stats.skipped_examples[0]
    )


def test_parquet_and_json_array_files(tmp_path, renderer):
    import datasets

    jsonl = write_conversations(tmp_path / "a.jsonl", 6, "sharegpt", seed=5)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "a.parquet"))
    (tmp_path / "a.json").write_text(json.dumps(records, indent=1))
    reference, _ = prepare(renderer, data_cfg([jsonl]))
    for name in ("a.parquet", "a.json"):
        other, _ = prepare(renderer, data_cfg([tmp_path / name]))
        assert other.input_ids.tolist() == reference.input_ids.tolist(), name
    skipped = SkipReport()
    sources = [c.source for c in read_conversations([str(tmp_path / "a.parquet")], skipped, "data.files")]
    assert sources[1] == f"{tmp_path / 'a.parquet'}:row 1"


def test_a_truncated_parquet_file_is_named(tmp_path):
    truncated = tmp_path / "cut.parquet"
    truncated.write_bytes(b"PAR1x")  # 5 bytes: what an interrupted download leaves
    with pytest.raises(
        ValueError, match=rf"^{truncated}: not a readable Parquet file \(ArrowInvalid: .*5 bytes"
    ):
        list(read_conversations([str(truncated)], SkipReport(), "data.files"))


def test_a_missing_file_names_the_config_key(tmp_path, renderer):
    with pytest.raises(ValueError, match=r"data.files: .*nope.jsonl is not a file"):
        prepare(renderer, data_cfg([tmp_path / "nope.jsonl"]))


def test_cache_is_reused_and_keyed_by_tokenizer_template_length_and_file_bytes(tmp_path, tiny_chat_dir):
    source = write_conversations(tmp_path / "chat.jsonl", 10)
    cache = tmp_path / "cache"
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_chat_dir))
    first, stats = load_or_prepare(renderer, data_cfg([source]), cache)
    again, stats_again = load_or_prepare(renderer, data_cfg([source]), cache)
    assert not stats.reused_cache and stats_again.reused_cache
    assert stats_again.cache_path == stats.cache_path and stats_again.samples == stats.samples
    assert again.input_ids.tolist() == first.input_ids.tolist()

    def cache_path_for(renderer_, cfg) -> str:
        return load_or_prepare(renderer_, cfg, cache)[1].cache_path

    assert cache_path_for(renderer, data_cfg([source], max_length=100)) != stats.cache_path
    copied = tmp_path / "elsewhere.jsonl"
    shutil.copy(source, copied)
    assert cache_path_for(renderer, data_cfg([copied])) == stats.cache_path  # same bytes, same data
    with source.open("a") as handle:
        handle.write(json.dumps({"messages": CONVERSATION}) + "\n")
    assert cache_path_for(renderer, data_cfg([source])) != stats.cache_path
    other_template = AutoTokenizer.from_pretrained(tiny_chat_dir)
    other_template.chat_template = other_template.chat_template.replace("<|im_start|>", "<|im_start|> ")
    assert cache_path_for(ChatRenderer(other_template), data_cfg([copied])) != stats.cache_path


def test_dflash_prep_builds_the_cache_training_reads(tmp_path, tiny_chat_dir, tiny_conversations, capsys):
    from dflash.run.launch import build_run
    from dflash.tools.prep import prep
    from tests.conftest import compose_config

    overrides = conversation_overrides(tiny_chat_dir, [tiny_conversations])
    cfg = compose_config(overrides, tmp_path / "prep", tmp_path / "cache")
    result = prep(cfg)
    out = capsys.readouterr().out
    assert "records read         40" in out and "(written)" in out
    cache_files = list((tmp_path / "cache" / "conversations").glob("*.safetensors"))
    assert len(cache_files) == 1
    run = build_run(
        compose_config([*overrides, "monitor.interval_s=0"], tmp_path / "run", tmp_path / "cache")
    )
    try:
        assert len(run.trainer.dataset) == result["samples"]
        assert list((tmp_path / "cache" / "conversations").glob("*.safetensors")) == cache_files
    finally:
        run.trainer.monitor.close(True)


def test_conversation_data_without_a_tokenizer_names_the_keys(tmp_path, tiny_conversations):
    from dflash.run.launch import build_run
    from tests.conftest import compose_config

    overrides = ["data=conversations", f"data.files=[{tiny_conversations}]", "data.max_length=128"]
    with pytest.raises(ValueError, match=r"target.tokenizer \(or target.path\)"):
        build_run(compose_config(overrides, tmp_path / "run", tmp_path / "cache"))


def test_unset_or_missing_files_name_the_key_before_any_model_loads(tmp_path):
    from dflash.run.launch import build_run
    from tests.conftest import compose_config

    with pytest.raises(ValueError, match=r"needs data.files="):
        build_run(compose_config(["data=conversations"], tmp_path / "run", tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"data.files: no such file '/nope.jsonl'"):
        build_run(
            compose_config(["data=conversations", "data.files=[/nope.jsonl]"], tmp_path / "r", tmp_path / "c")
        )


def test_parallel_tokenization_gives_the_same_samples(tmp_path, renderer):
    source = write_conversations(tmp_path / "chat.jsonl", 30, seed=8)
    single, _ = prepare(renderer, data_cfg([source]))
    parallel, _ = prepare(renderer, data_cfg([source], num_proc=2))
    assert parallel.input_ids.tolist() == single.input_ids.tolist()
    assert parallel.loss_mask.tolist() == single.loss_mask.tolist()


MARKED_TEMPLATE = (  # marks replies itself, and drops the reasoning of each reply
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'].split('</think>')[-1] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_generation_blocks_supplies_its_own_mask(tiny_chat_dir, renderer):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    tokenizer.chat_template = MARKED_TEMPLATE
    marked = ChatRenderer(tokenizer)
    assert marked.template_marks_replies and not renderer.template_marks_replies
    # Same rendering as the plain template: the same tokens and the same mask either way.
    assert marked.tokenize(CONVERSATION) == renderer.tokenize(CONVERSATION)
    # A reply the template rewrites: found by nobody verbatim, masked by the template itself.
    thinking = [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "<think>hmm</think>Because."},
    ]
    ids, mask = marked.tokenize(thinking)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "Because.<|im_end|>"
    plain_template_with_rewrite = AutoTokenizer.from_pretrained(tiny_chat_dir)
    plain_template_with_rewrite.chat_template = MARKED_TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    with pytest.raises(MalformedRecord, match="rewrites this assistant content"):
        ChatRenderer(plain_template_with_rewrite).tokenize(thinking)


def test_streaming_in_chunks_gives_the_same_samples_and_counts(tmp_path, renderer, monkeypatch):
    from dflash.data import prepare as prepare_module

    source = write_conversations(tmp_path / "chat.jsonl", 25, seed=9)
    with source.open("a") as handle:
        handle.write("{broken\n")
    whole, whole_stats = prepare(renderer, data_cfg([source]))
    monkeypatch.setattr(prepare_module, "CHUNK", 4)
    chunks, chunk_stats = prepare(renderer, data_cfg([source]))
    assert chunks.input_ids.tolist() == whole.input_ids.tolist()
    assert chunks.offsets.tolist() == whole.offsets.tolist()
    assert chunk_stats == whole_stats and whole_stats.records == 26


def test_chat_template_variables_reach_every_rendering_and_the_cache_key(tiny_chat_dir, tmp_path):
    from dflash.config.schema import TargetConfig
    from dflash.data.chat import load_chat_renderer

    directory = shutil.copytree(tiny_chat_dir, tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}",
    )
    tokenizer.save_pretrained(directory)
    thinking = load_chat_renderer(TargetConfig(name="t", path=str(directory)), "test")
    quiet = load_chat_renderer(
        TargetConfig(name="t", path=str(directory), chat_template_kwargs={"enable_thinking": False}), "test"
    )
    question = [{"role": "user", "content": "Why?"}]
    assert quiet.render_text(question, add_generation_prompt=True).endswith("<think></think>")
    assert not thinking.render_text(question, add_generation_prompt=True).endswith("<think></think>")
    assert quiet.prompt_ids(question) != thinking.prompt_ids(question)
    assert quiet.fingerprint() != thinking.fingerprint()


def test_a_conversation_the_template_refuses_is_skipped_with_the_reason(tmp_path, tiny_chat_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    tokenizer.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}" + tokenizer.chat_template
    )
    path = tmp_path / "c.jsonl"
    path.write_text(
        json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": CONVERSATION[1:]}) + "\n"
    )
    dataset, stats = prepare(ChatRenderer(tokenizer), data_cfg([path]))
    assert len(dataset) == 1 and stats.skipped == {"template": 1}
    assert stats.skipped_examples == [
        f"{path}:1: the chat template refuses this conversation: System role not supported"
    ]


def test_files_may_be_globs_or_directories(tmp_path, renderer):
    shards = tmp_path / "shards"
    shards.mkdir()
    paths = [write_conversations(shards / f"part-{i}.jsonl", 4, seed=i) for i in range(3)]
    (shards / "README.txt").write_text("not data")
    explicit, _ = prepare(renderer, data_cfg(paths))
    for entry in (str(shards / "part-*.jsonl"), str(shards)):
        expanded, _ = prepare(renderer, data_cfg([entry]))
        assert expanded.input_ids.tolist() == explicit.input_ids.tolist(), entry
    with pytest.raises(ValueError, match=r"data.files: '.*nothing-\*.jsonl' matches no file"):
        prepare(renderer, data_cfg([str(shards / "nothing-*.jsonl")]))


def test_a_directory_is_read_recursively_in_every_supported_form(tmp_path, renderer, caplog):
    """.jsonl, .JSONL, .jsonl.gz, .json.zst and a subdirectory are all read (150 of 150 records,
    where only the plain .jsonl files were before); other files are named in a warning; a line
    that is not UTF-8 is skipped and counted, not trained on as replacement characters."""
    import gzip

    import zstandard

    root = tmp_path / "data"
    (root / "more").mkdir(parents=True)
    plain = write_conversations(root / "a.jsonl", 30, seed=1)
    upper = write_conversations(root / "B.JSONL", 30, seed=2)
    nested = write_conversations(root / "more" / "c.jsonl", 30, seed=3)
    gz = write_conversations(tmp_path / "d.jsonl", 30, seed=4)
    (root / "d.jsonl.gz").write_bytes(gzip.compress(gz.read_bytes()))
    zst = write_conversations(tmp_path / "e.json", 30, seed=5)
    (root / "more" / "e.json.zst").write_bytes(zstandard.ZstdCompressor().compress(zst.read_bytes()))
    (root / "notes.txt").write_text("not data")
    (root / ".out.jsonl.lock").write_text("")  # hidden: passed over without a word
    with plain.open("ab") as handle:
        handle.write(
            b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "x"}]}\n'
        )
    skipped = SkipReport()
    with caplog.at_level("WARNING"):
        conversations = list(read_conversations([str(root)], skipped, "data.files"))
    assert len(conversations) == 150
    assert skipped.counts == {"invalid_utf8": 1} and "a.jsonl:31" in skipped.examples[0]
    warnings = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(warnings) == 1 and "1 file(s) not read" in warnings[0] and "notes.txt" in warnings[0]
    by_path = {str(p) for p in (plain, upper, nested)}
    assert {c.source.rsplit(":", 1)[0] for c in conversations} >= by_path


def test_an_eval_prompt_that_is_not_text_is_refused_with_its_line(tmp_path, renderer):
    from dflash.eval.prompt_sets import read_prompt_file

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello"}\n{"prompt": null}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: .*the prompt is None, not a non-empty string"):
        read_prompt_file("mine", str(path), renderer, limit=10)
    path.write_text('{"prompt": 42}\n')
    with pytest.raises(ValueError, match="the prompt is 42"):
        read_prompt_file("mine", str(path), renderer, limit=10)


def test_a_repeated_conversation_is_counted_and_a_renamed_cache_names_this_runs_files(tmp_path, renderer):
    source = write_conversations(tmp_path / "a.jsonl", 6, seed=7)
    lines = source.read_text().splitlines()
    source.write_text("\n".join([*lines, lines[1], "{broken"]) + "\n")
    dataset, stats = load_or_prepare(renderer, data_cfg([source]), tmp_path / "cache")
    assert stats.samples == 7 and stats.duplicates == 1 and stats.skipped == {"invalid_json": 1}
    assert (
        len(dataset) == 7
        and "duplicates           1 conversations repeat an earlier one (kept)" in stats.lines()
    )
    renamed = tmp_path / "b.jsonl"
    source.rename(renamed)
    _, again = load_or_prepare(renderer, data_cfg([renamed]), tmp_path / "cache")
    assert again.reused_cache and again.skipped == stats.skipped
    assert all(example.startswith(f"{renamed}:") for example in again.skipped_examples), (
        again.skipped_examples
    )


# Three template shapes users train on, written out: Llama-3 (each turn trimmed), Qwen3 (an empty
# think block before the final reply in non-thinking mode), and one that injects a system prompt.
LLAMA3_TRIM = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN3_THINKING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SYSTEM_INJECTING = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant; say a "
    "when asked.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A user turn that ends in whitespace and holds the reply's words; a one-character reply that
# also occurs inside the template's own markup ("a" in "assistant").
TRICKY = [
    {"role": "user", "content": "Repeat after me: hello world "},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "Now just the letter a"},
    {"role": "assistant", "content": "a"},
]


@pytest.mark.parametrize(
    "template,end_of_turn,replies,prompt_is_prefix",
    [
        (None, "<|im_end|>", ["hello world<|im_end|>", "a<|im_end|>"], True),
        (LLAMA3_TRIM, "<|eot_id|>", ["hello world<|eot_id|>", "a<|eot_id|>"], True),
        # The generation prompt ends in the empty think block, which an earlier reply of the
        # whole conversation does not get: no span can be found from the prompt's length there.
        (QWEN3_THINKING, "<|im_end|>", ["hello world<|im_end|>", "a<|im_end|>"], False),
        (SYSTEM_INJECTING, "<|im_end|>", ["hello world<|im_end|>", "a<|im_end|>"], True),
    ],
    ids=["chatml", "llama3_trim", "qwen3_thinking", "system_injecting"],
)
def test_masks_come_from_where_the_template_writes_each_reply(
    tiny_chat_dir, template, end_of_turn, replies, prompt_is_prefix
):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    if template is not None:
        tokenizer.chat_template = template
    renderer = ChatRenderer(tokenizer, {"enable_thinking": False})
    assert renderer.end_of_turn == end_of_turn
    text = renderer.render_text(TRICKY)
    spans = renderer.assistant_spans(text, TRICKY)
    assert [text[start:end] for start, end in spans] == replies
    # Where the generation prompt of the conversation so far is part of the full rendering, the
    # first reply's span starts right where it ends.
    prompt = renderer.render_text(TRICKY[:1], add_generation_prompt=True)
    assert text.startswith(prompt) == prompt_is_prefix
    if prompt_is_prefix:
        assert spans[0][0] == len(prompt)
    ids, mask = renderer.tokenize(TRICKY)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    for (token_start, _), supervised in zip(offsets, mask):
        assert supervised == any(start <= token_start < end for start, end in spans)


def test_a_reply_the_template_rewrites_is_refused_not_guessed(tiny_chat_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    tokenizer.chat_template = SYSTEM_INJECTING.replace("{{ m['content'] }}", "{{ m['content'] | upper }}")
    with pytest.raises(ValueError, match="rewrites assistant content"):
        ChatRenderer(tokenizer)
    # One that rewrites some replies only (a reply holding a reasoning block, here): that record
    # is refused with its index, not given a guessed mask.
    tokenizer.chat_template = QWEN3_THINKING.replace("{{ m['content'] }}<|im_end|>\n{% else %}", "{{ m['content'].split('</think>')[-1] }}<|im_end|>\n{% else %}")  # fmt: skip
    renderer = ChatRenderer(tokenizer)
    reasoning = [TRICKY[0], {"role": "assistant", "content": "<think>hmm</think>hello world"}]
    assert renderer.tokenize(TRICKY)[1].count(1) > 0
    with pytest.raises(MalformedRecord, match=r"messages\[1\]: the chat template rewrites"):
        renderer.tokenize(reasoning)


def test_a_saved_datasets_directory_reads_like_its_files_and_names_split_and_row(tmp_path, renderer):
    """`data.files` (and regen's input) takes what `save_to_disk` wrote: a Dataset, or a
    DatasetDict whose splits are read in name order; a bad row is located by split and row."""
    import datasets

    jsonl = write_conversations(tmp_path / "a.jsonl", 6, "sharegpt", seed=5)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    reference, _ = prepare(renderer, data_cfg([jsonl]))
    saved, stats = prepare(renderer, data_cfg([tmp_path / "saved"]))
    assert saved.input_ids.tolist() == reference.input_ids.tolist()
    assert stats.files == [str(tmp_path / "saved")]

    broken = [*records[3:], {"conversations": [{"from": "wizard", "value": "hi"}], "id": 99}]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records[:3]), "validation": datasets.Dataset.from_list(broken)}
    ).save_to_disk(str(tmp_path / "tree" / "dict"))
    skipped = SkipReport()
    # Found inside a directory, read once (its splits are saved Datasets of their own).
    read = list(read_conversations([str(tmp_path / "tree")], skipped, "data.files"))
    assert [c.messages for c in read] == [normalize(r)[0] for r in records]
    assert read[3].source == f"{tmp_path / 'tree' / 'dict'}:validation row 0"
    assert skipped.examples == [
        f"{tmp_path / 'tree' / 'dict'}:validation row 3: conversations[0]: unknown role 'wizard'"
    ]


def test_turns_under_other_names_are_read_with_a_named_layout(tmp_path, renderer):
    from dflash.data.conversations import RecordLayout

    renamed = [
        {"chat": [{"speaker": r["role"], "text": r["content"]} for r in CONVERSATION], "id": 1},
        {"chat": [{"speaker": "user", "words": "no text key"}], "id": 2},
    ]
    path = tmp_path / "renamed.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in renamed) + "\n")
    layout = RecordLayout(field="chat", role="speaker", content="text")
    messages, extra = normalize(renamed[0], layout=layout)
    assert messages == CONVERSATION and extra == {"id": 1}
    skipped = SkipReport()
    assert len(list(read_conversations([str(path)], skipped, "data.files", layout))) == 1
    assert skipped.examples == [f"{path}:2: chat[0] needs 'speaker' and 'text'"]
    with pytest.raises(
        MalformedRecord, match=r"no 'messages' \(OpenAI\) or 'conversations' \(ShareGPT\) field"
    ):
        normalize(renamed[0])  # the auto layout does not guess other names

    # Named fields holding either standard turn shape, as a datasets column.
    sharegpt_column = {"dialogue": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hi."}]}
    assert normalize(sharegpt_column, layout=RecordLayout(field="dialogue"))[0] == [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hi."},
    ]

    # The config node reaches the tokenized data and its cache key.
    cfg = data_cfg([path], min_supervised_tokens=1)
    cfg.layout.field, cfg.layout.role, cfg.layout.content = "chat", "speaker", "text"
    dataset, stats = prepare(renderer, cfg)
    assert len(dataset) == 1 and stats.skipped == {"malformed": 1}
    from dflash.data.prepare import cache_key

    assert cache_key(renderer, cfg) != cache_key(renderer, data_cfg([path]))
