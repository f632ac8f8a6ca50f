"""dflash-regen: the target's own replies replace the assistant turns, turn by turn; resumable;
the OpenAI-compatible HTTP backend against a real loopback server serving the tiny target."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from dflash.config.schema import RegenBackend, SamplingConfig, TargetConfig
from dflash.data.chat import ChatRenderer
from dflash.decoding.reference import plain_generate
from dflash.decoding.settings import DecodeSettings
from dflash.regen.backends import HttpBackend, TransformersBackend
from dflash.regen.regenerate import regenerate
from dflash.target.model import FrozenTarget
from tests.openai_server import LoopbackChatServer
from tests.tiny_assets import write_conversations

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)


@pytest.fixture(scope="module")
def chat_target(tiny_chat_dir):
    target = FrozenTarget.from_config(
        TargetConfig(name="tiny", path=str(tiny_chat_dir)), [1, 3], torch.device("cpu")
    )
    return target, ChatRenderer(AutoTokenizer.from_pretrained(tiny_chat_dir))


@pytest.fixture(params=["continuous", "generate"])
def backend(request, chat_target):
    """Both in-process paths: continuous batching on the static cache, and the generate()
    batches that targets without a static cache (a sliding attention window) use."""
    backend = TransformersBackend(*chat_target, GREEDY, slots=3, max_len=256)
    assert backend.continuous
    if request.param == "generate":
        backend.batcher = None
    return backend


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replies_are_the_targets_greedy_continuations_turn_by_turn(tmp_path, chat_target, backend):
    target, renderer = chat_target
    source = write_conversations(tmp_path / "in.jsonl", 6, "sharegpt", seed=1)
    out = tmp_path / "out.jsonl"
    stats = regenerate(backend, [str(source)], out, batch_size=4)
    records = sorted(read_jsonl(out), key=lambda r: r["id"])  # written as conversations finish
    originals = [json.loads(line) for line in source.read_text().splitlines()]
    assert stats.written == 6 and len(records) == 6
    assert stats.generated_tokens > 6
    assert stats.replies == sum(sum(t["from"] == "gpt" for t in o["conversations"]) for o in originals)
    eos = renderer.tokenizer.eos_token_id
    for record, original in zip(records, originals):
        assert record["id"] == original["id"] and record["source"].endswith(f"in.jsonl:{original['id'] + 1}")
        messages = record["messages"]
        # Non-assistant turns are kept verbatim and in order; every reply is the target's.
        kept = [{"role": {"human": "user"}.get(t["from"], t["from"]), "content": t["value"]} for t in original["conversations"] if t["from"] != "gpt"]  # fmt: skip
        assert [m for m in messages if m["role"] != "assistant"] == kept
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = renderer.prompt_ids(messages[:index])  # includes earlier regenerated replies
            ids = plain_generate(target, prompt, DecodeSettings(GREEDY.max_new_tokens)).output_ids
            ids = ids[: ids.index(eos)] if eos in ids else ids
            assert message["content"] == renderer.tokenizer.decode(ids, skip_special_tokens=True)
            assert message["content"] not in [t["value"] for t in original["conversations"]]


def test_an_interrupted_run_resumes_without_writing_anything_twice(tmp_path, backend):
    source = write_conversations(tmp_path / "in.jsonl", 10, seed=2)
    out = tmp_path / "out.jsonl"
    first = regenerate(backend, [str(source)], out, batch_size=3, limit=4)  # "interrupted" after 4
    assert first.written == 4
    head = out.read_text()
    with out.open("a") as handle:
        handle.write('{"messages": [{"role": "user", "content": "torn')  # a crash mid-line
    second = regenerate(backend, [str(source)], out, batch_size=3)
    assert second.already_done == 4 and second.written == 6
    records = read_jsonl(out)
    assert out.read_text().startswith(head)  # earlier lines untouched
    assert sorted(r["id"] for r in records) == list(range(10))  # each exactly once
    third = regenerate(backend, [str(source)], out, batch_size=3)
    assert third.written == 0 and len(read_jsonl(out)) == 10


def test_http_backend_against_a_loopback_server_with_retries(tmp_path, backend):
    source = write_conversations(tmp_path / "in.jsonl", 8, seed=4)
    lines = source.read_text().splitlines()
    poisoned = json.loads(lines[5])
    poisoned["messages"][-2 if poisoned["messages"][-1]["role"] == "assistant" else -1]["content"] += (
        " POISON"
    )
    lines[5] = json.dumps(poisoned)
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    with LoopbackChatServer(backend, fail_first=2) as server:
        http = HttpBackend(
            url=server.url,
            model=None,
            api_key="EMPTY",
            sampling=GREEDY,
            concurrency=4,
            timeout_s=30,
            max_retries=2,
        )
        assert http.model == "tiny-chat"
        stats = regenerate(http, [str(source)], out, batch_size=4)
        served = {json.dumps(m): reply for m, reply in server.served}
    # Two 503s were retried away; the poisoned conversation failed for good and is not written.
    assert stats.failed == 1 and stats.written == 7
    assert server.max_active > 1  # several conversations in flight at once
    records = read_jsonl(out)
    assert 5 not in [r["id"] for r in records]
    for record in records:
        messages = record["messages"]
        for index, message in enumerate(messages):
            if message["role"] == "assistant":
                assert served[json.dumps(messages[:index])] == message["content"]
    # Rerun with the poison gone: only the missing conversation is requested and written.
    lines[5] = json.dumps(json.loads(write_conversations(tmp_path / "clean.jsonl", 8, seed=4).read_text().splitlines()[5]))  # fmt: skip
    source.write_text("\n".join(lines) + "\n")
    with LoopbackChatServer(backend) as server:
        http = HttpBackend(
            url=server.url,
            model="tiny-chat",
            api_key="EMPTY",
            sampling=GREEDY,
            concurrency=4,
            timeout_s=30,
            max_retries=0,
        )
        again = regenerate(http, [str(source)], out, batch_size=4)
    assert again.already_done == 7 and again.written == 1 and again.failed == 0
    assert sorted(r["id"] for r in read_jsonl(out)) == list(range(8))


def test_regen_cli_composes_and_runs(tmp_path, tiny_chat_dir, capsys):
    from dflash.tools.compose import compose_config
    from dflash.tools.regen import build_backend, regen

    source = write_conversations(tmp_path / "in.jsonl", 3, seed=6)
    cfg = compose_config(
        config_name="regen",
        overrides=[
            f"target.path={tiny_chat_dir}",
            f"input=[{source}]",
            f"output={tmp_path / 'out.jsonl'}",
            "sampling.temperature=0.8",
            "sampling.max_new_tokens=8",
            f"paths.output_dir={tmp_path}",
            f"paths.cache_dir={tmp_path}",
        ],
    )
    stats = regen(cfg)
    assert stats.written == 3
    assert "written              3 conversations" in capsys.readouterr().out
    typed = OmegaConf.to_object(cfg)
    typed.backend = RegenBackend.http
    with pytest.raises(ValueError, match="backend=http needs url="):
        build_backend(typed)


def test_regen_reads_a_saved_dataset_with_renamed_turns(tmp_path, tiny_chat_dir, capsys):
    """regen's input, like data.files, takes a save_to_disk directory, and `layout` names the
    turns' column and keys."""
    import datasets

    from dflash.tools.compose import compose_config
    from dflash.tools.regen import regen

    source = write_conversations(tmp_path / "in.jsonl", 3, seed=6)
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    renamed = [{"dialog": [{"who": m["role"], "said": m["content"]} for m in r["messages"]]} for r in rows]
    datasets.Dataset.from_list(renamed).save_to_disk(str(tmp_path / "saved"))
    cfg = compose_config(
        config_name="regen",
        overrides=[
            f"target.path={tiny_chat_dir}",
            f"input=[{tmp_path / 'saved'}]",
            f"output={tmp_path / 'out.jsonl'}",
            "layout.field=dialog",
            "layout.role=who",
            "layout.content=said",
            "sampling.max_new_tokens=4",
            f"paths.output_dir={tmp_path}",
            f"paths.cache_dir={tmp_path}",
        ],
    )
    assert regen(cfg).written == 3

    def questions(records):  # in any order: replies are written as they finish
        return sorted(tuple(m["content"] for m in r["messages"] if m["role"] == "user") for r in records)

    assert questions(read_jsonl(tmp_path / "out.jsonl")) == questions(rows)
    capsys.readouterr()


def test_unset_sampling_fields_take_the_targets_recommendation(tmp_path, tiny_chat_dir):
    import shutil

    from transformers import GenerationConfig

    directory = shutil.copytree(tiny_chat_dir, tmp_path / "target")
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20).save_pretrained(directory)
    target = FrozenTarget.from_config(TargetConfig(name="t", path=str(directory)), [1], torch.device("cpu"))
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(directory))

    def options(**fields):
        return TransformersBackend(target, renderer, SamplingConfig(**fields)).generate_options()

    assert options() == {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert options(top_k=5)["top_k"] == 5 and options(top_k=5)["temperature"] == 0.6
    assert options(temperature=0.0) == {"do_sample": False}
    # Over HTTP, unset fields are not sent (the server applies the model's defaults).
    http = HttpBackend(
        url="http://127.0.0.1:9/v1",
        model="m",
        api_key="EMPTY",
        sampling=SamplingConfig(top_k=7),
        concurrency=1,
        timeout_s=1.0,
        max_retries=0,
    )
    assert http.request_options() == {"max_tokens": 2048, "seed": 0, "extra_body": {"top_k": 7}}


def test_http_requests_carry_the_targets_chat_template_variables():
    http = HttpBackend(
        url="http://127.0.0.1:9/v1",
        model="m",
        api_key="EMPTY",
        sampling=SamplingConfig(temperature=0.0),
        concurrency=1,
        timeout_s=1.0,
        max_retries=0,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert http.request_options() == {
        "max_tokens": 2048,
        "seed": 0,
        "temperature": 0.0,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }


def test_a_conversation_the_template_refuses_is_left_out_not_fatal(tmp_path, chat_target, tiny_chat_dir):
    target, _ = chat_target
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_dir)
    tokenizer.chat_template = (
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}" + tokenizer.chat_template
    )
    source = tmp_path / "in.jsonl"
    question = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]
    records = [{"messages": question}, {"messages": [{"role": "system", "content": "Be brief."}, *question]}]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    backend = TransformersBackend(target, ChatRenderer(tokenizer), GREEDY)
    stats = regenerate(backend, [str(source)], tmp_path / "out.jsonl", batch_size=2)
    assert stats.written == 1 and stats.failed == 1
    assert read_jsonl(tmp_path / "out.jsonl")[0]["source"].endswith("in.jsonl:1")


def test_a_crash_mid_run_keeps_what_was_written_and_the_rerun_finishes(tmp_path, backend):
    source = write_conversations(tmp_path / "in.jsonl", 9, seed=7)
    out = tmp_path / "out.jsonl"
    method = "poll" if backend.continuous else "generate"  # what the run calls per step
    real = getattr(backend, method)

    def dies_once_something_was_written(*args):
        if out.exists() and out.read_text():
            raise KeyboardInterrupt  # Ctrl-C, or the job's time limit
        return real(*args)

    setattr(backend, method, dies_once_something_was_written)
    with pytest.raises(KeyboardInterrupt):
        regenerate(backend, [str(source)], out, batch_size=1)
    survivors = read_jsonl(out)
    assert 1 <= len(survivors) < 9  # finished conversations were flushed before the crash
    setattr(backend, method, real)
    rerun = regenerate(backend, [str(source)], out, batch_size=1)
    assert rerun.already_done == len(survivors) and rerun.written == 9 - len(survivors)
    assert sorted(r["id"] for r in read_jsonl(out)) == list(range(9))


class NoRequests:
    """A backend that fails the test if regen asks it anything."""

    conversations_in_flight = False
    continuous = False

    def generate(self, *args, **kwargs):
        raise AssertionError("a request was made before the output was checked")


@pytest.mark.parametrize(
    "layout", ["same_file", "same_file_absolute", "hard_link", "in_input_dir", "matches_glob"]
)
def test_an_output_the_inputs_include_is_refused_before_any_request(tmp_path, monkeypatch, layout):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    write_conversations(data / "chat.jsonl", 5)
    inputs, output = {
        "same_file": (["data/chat.jsonl"], data / "chat.jsonl"),
        "same_file_absolute": ([str(data / "chat.jsonl")], Path("data/chat.jsonl")),
        "hard_link": (["data/chat.jsonl"], tmp_path / "linked.jsonl"),
        "in_input_dir": (["data"], data / "regen.jsonl"),  # not there yet: created by the run
        "matches_glob": (["data/*.jsonl"], data / "regen.jsonl"),
    }[layout]
    if layout == "hard_link":
        os.link(data / "chat.jsonl", output)
    before = (data / "chat.jsonl").read_text()
    with pytest.raises(ValueError, match="regen.output=.* would be read as an input"):
        regenerate(NoRequests(), inputs, output, batch_size=2)
    assert (data / "chat.jsonl").read_text() == before
    assert layout in ("same_file", "same_file_absolute", "hard_link") or not output.exists()


def test_a_second_regen_on_the_same_output_is_refused_while_the_first_lives(tmp_path, backend):
    from dflash.lock import FileLock

    source = write_conversations(tmp_path / "in.jsonl", 3)
    out = tmp_path / "out.jsonl"
    first = FileLock(tmp_path / ".out.jsonl.lock", lambda holder: ValueError(holder)).acquire()
    try:
        with pytest.raises(
            ValueError,
            match=f"regen.output={out} is being written by another dflash regen \\(pid {os.getpid()}",
        ):
            regenerate(backend, [str(source)], out, batch_size=2)
        assert not out.exists() or out.read_text() == ""
    finally:
        first.release()
    assert regenerate(backend, [str(source)], out, batch_size=2).written == 3  # the lock is free again
    assert regenerate(backend, [str(source)], out, batch_size=2).written == 0  # and released after a run
