"""dflash-regen under faults: every bad HTTP answer is a counted failure (never a crash), a run
where too many fail exits 2 with a run record, the API key comes from OPENAI_API_KEY and never
lands in a record, resume is keyed by content, and SIGTERM leaves a record and the output whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dflash.config.schema import SamplingConfig, TargetConfig
from dflash.data.chat import ChatRenderer
from dflash.regen.backends import HttpBackend, TransformersBackend
from dflash.regen.regenerate import regenerate
from dflash.target.model import FrozenTarget
from tests.conftest import SLOW_MACHINE_TIMEOUT_S
from tests.openai_server import LoopbackChatServer
from tests.tiny_assets import write_conversations

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6)
BAD_ANSWERS = {
    "EMPTYCHOICES": (
        "application/json",
        json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode(),
    ),
    "HTMLPAGE": ("text/html", b"<html><body>502 Bad Gateway</body></html>"),
    "NOTJSON": ("application/json", b"{this is not json"),
    "NULLCONTENT": (
        "application/json",
        json.dumps(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": "tiny-chat",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": None}, "finish_reason": "stop"}
                ],
            }
        ).encode(),
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def served(tiny_chat_dir):
    target = FrozenTarget.from_config(
        TargetConfig(name="tiny", path=str(tiny_chat_dir)), [1], torch.device("cpu")
    )
    return TransformersBackend(target, ChatRenderer(AutoTokenizer.from_pretrained(tiny_chat_dir)), GREEDY, slots=2, max_len=256)  # fmt: skip


def mark(source: Path, markers: dict[int, str]) -> None:
    """Append a marker to the first user turn of the given records."""
    lines = source.read_text().splitlines()
    for index, marker in markers.items():
        record = json.loads(lines[index])
        first_user = next(m for m in record["messages"] if m["role"] == "user")
        first_user["content"] += f" {marker}"
        lines[index] = json.dumps(record)
    source.write_text("\n".join(lines) + "\n")


def http(server: LoopbackChatServer, api_key: str = "EMPTY") -> HttpBackend:
    return HttpBackend(
        url=server.url,
        model="tiny-chat",
        api_key=api_key,
        sampling=GREEDY,
        concurrency=3,
        timeout_s=30,
        max_retries=0,
    )


def test_each_bad_answer_is_a_counted_failure_not_a_crash(tmp_path, served):
    source = write_conversations(tmp_path / "in.jsonl", 6, seed=2)
    mark(source, dict(enumerate(BAD_ANSWERS)))
    out = tmp_path / "out.jsonl"
    with LoopbackChatServer(served, bad_answers=BAD_ANSWERS) as server:
        stats = regenerate(http(server), [str(source)], out, batch_size=3)
    assert stats.failed == len(BAD_ANSWERS) and stats.written == 6 - len(BAD_ANSWERS)
    for record in map(json.loads, out.read_text().splitlines()):
        assert all(m["content"] for m in record["messages"] if m["role"] == "assistant")


def run_regen(tmp_path: Path, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash.tools.regen",
            "backend=http",
            f"hydra.run.dir={tmp_path / 'run'}",
            *args,
        ],
        env={**clean, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_a_run_where_most_requests_fail_exits_2_with_its_counts_recorded(tmp_path, served):
    source = write_conversations(tmp_path / "in.jsonl", 5, seed=3)
    mark(source, {0: "POISON", 1: "POISON", 2: "HTMLPAGE"})
    out = tmp_path / "out.jsonl"
    with LoopbackChatServer(served, bad_answers=BAD_ANSWERS) as server:
        done = run_regen(tmp_path, f"url={server.url}", f"input=[{source}]", f"output={out}", "max_retries=0")
        _, stderr = done.communicate(timeout=SLOW_MACHINE_TIMEOUT_S)
    assert done.returncode == 2, stderr
    assert "3 of 5 conversations failed (more than max_failed_frac=0.01)" in stderr
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "FAILED"
    assert record["metrics"]["failed"] == 3 and record["metrics"]["written"] == 2
    assert len(out.read_text().splitlines()) == 2  # what succeeded stays written


def test_the_api_key_comes_from_the_environment_and_never_lands_in_a_record(tmp_path, served):
    source = write_conversations(tmp_path / "in.jsonl", 2, seed=4)
    with LoopbackChatServer(served) as server:
        args = (f"url={server.url}", f"input=[{source}]")
        first = run_regen(
            tmp_path, *args, f"output={tmp_path / 'a.jsonl'}", env={"OPENAI_API_KEY": "sk-from-env-1"}
        )
        assert first.wait(timeout=SLOW_MACHINE_TIMEOUT_S) == 0, first.stderr.read()
        assert set(server.authorizations) == {"Bearer sk-from-env-1"}
        server.authorizations.clear()
        typed = run_regen(tmp_path, *args, f"output={tmp_path / 'b.jsonl'}", "api_key=sk-typed-2", "hydra.run.dir=" + str(tmp_path / "run2"))  # fmt: skip
        assert typed.wait(timeout=SLOW_MACHINE_TIMEOUT_S) == 0, typed.stderr.read()
        assert set(server.authorizations) == {"Bearer sk-typed-2"}
    for run_dir in (tmp_path / "run", tmp_path / "run2"):
        for path in [run_dir / "run.json", *(run_dir / ".hydra").glob("*.yaml")]:
            text = path.read_text()
            assert "sk-from-env-1" not in text and "sk-typed-2" not in text, path
    record = json.loads((tmp_path / "run2" / "run.json").read_text())
    assert record["config"]["api_key"] == "***" and "api_key=***" in record["overrides"]


def test_resume_is_keyed_by_content_not_by_how_the_input_is_named(tmp_path, served, monkeypatch):
    """The same inputs by a relative path, then an absolute one, then with a duplicate record
    added: nothing is regenerated twice, and the duplicate is counted."""
    source = write_conversations(tmp_path / "in.jsonl", 4, seed=5)
    out = tmp_path / "out.jsonl"
    monkeypatch.chdir(tmp_path)
    with LoopbackChatServer(served) as server:
        first = regenerate(http(server), ["in.jsonl"], out, batch_size=2)
        again = regenerate(http(server), [str(source.resolve())], out, batch_size=2)
        lines = source.read_text().splitlines()
        source.write_text("\n".join([lines[2], *lines]) + "\n")  # reordered, one record twice
        third = regenerate(http(server), [str(source)], out, batch_size=2)
    assert first.written == 4 and again.written == 0 and again.already_done == 4
    assert third.written == 0 and third.skipped.counts == {"duplicate": 1}
    assert len(out.read_text().splitlines()) == 4


def test_sigterm_leaves_a_run_record_and_every_written_line_whole(tmp_path, served):
    source = write_conversations(tmp_path / "in.jsonl", 40, seed=6)
    out = tmp_path / "out.jsonl"
    with LoopbackChatServer(served, delay_s=0.2) as server:
        running = run_regen(
            tmp_path, f"url={server.url}", f"input=[{source}]", f"output={out}", "batch_size=2"
        )
        deadline = time.monotonic() + SLOW_MACHINE_TIMEOUT_S
        while not (out.is_file() and out.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.1)
        running.send_signal(signal.SIGTERM)
        _, stderr = running.communicate(timeout=SLOW_MACHINE_TIMEOUT_S)
    assert running.returncode == 128 + signal.SIGTERM, stderr
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["status"] == "INTERRUPTED" and record["signal"] == "SIGTERM"
    written = out.read_text().splitlines()
    assert 2 <= len(written) < 40 and record["metrics"]["written"] == len(written)
    assert all(json.loads(line)["messages"] for line in written)


def test_a_line_regen_did_not_write_in_its_output_is_named_by_file_and_line(tmp_path):
    from dflash.regen.regenerate import finished_sources

    output = tmp_path / "out.jsonl"
    output.write_text('{"source": "a.jsonl:1", "messages": []}\nnot json at all\n')
    with pytest.raises(
        ValueError, match=rf"^{output}:2: not a record dflash regen wrote \(Expecting value\)"
    ):
        finished_sources(output)
    output.write_text('{"source": "a.jsonl:1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"^{output}:2: not a record dflash regen wrote \(no source"):
        finished_sources(output)


def test_a_full_disk_while_regen_writes_names_the_output(tmp_path):
    import errno

    from dflash.regen.regenerate import RegenStats, _Writer

    class FullDisk:
        name = str(tmp_path / "out.jsonl")

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def fileno(self):
            return os.open(self.name, os.O_WRONLY | os.O_CREAT)

    writer = _Writer(FullDisk(), RegenStats())
    with pytest.raises(OSError, match=rf"^\[Errno 28\] writing regen.output={tmp_path / 'out.jsonl'} failed \(No space left on device\)"):  # fmt: skip
        writer([{"source": "a.jsonl:1"}])
    writer.close()
