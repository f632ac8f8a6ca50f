"""Replace every assistant turn of a conversation set with the target's own reply.

Turn by turn: the reply to user turn k is generated from the conversation so far with the
earlier assistant turns already replaced, so each training sample is a conversation the target
could have had. In-process generation decodes `batch_size` replies at once with continuous batching (a
finished reply's slot takes the next prompt at once), or, for targets without a static cache,
takes `batch_size` conversations per generate batch, turn by turn; a server backend keeps
`batch_size` conversations in flight, each on its own.

Resumable, nothing written twice: the output is JSON Lines, one line per finished
conversation (written and flushed whole), keyed by the source conversation's content (a digest
of its messages, `source_digest`), so naming the inputs another way (an absolute path, a glob,
another order) never regenerates or skips one; the same conversation twice in the inputs is
answered once and counted as a duplicate. A rerun reads the keys already present, drops a torn
last line left by a crash, and does only the rest. A conversation whose request failed for good
is not written, so a rerun retries it. One live process per output (an exclusive lock beside
it), and never an output that the inputs include.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.conversations import (
    AUTO_LAYOUT,
    Conversation,
    RecordLayout,
    SkipReport,
    chunked,
    conversation_digest,
    drop_repeats,
    entry_reads,
    read_conversations,
)
from dflash.lock import FileLock
from dflash.regen.backends import RegenBackend, Reply

log = logging.getLogger(__name__)


@dataclass
class RegenStats:
    already_done: int = 0  # found in the output at start
    written: int = 0
    failed: int = 0  # a request failed after every retry (retried by the next run)
    replies: int = 0
    cut_at_length: int = 0  # replies that hit sampling.max_new_tokens
    generated_tokens: int = 0  # in the replies (as far as the backend reports them)
    skipped: SkipReport = field(default_factory=SkipReport)
    started: float = field(default_factory=time.monotonic)

    def add(self, other: RegenStats) -> None:
        self.failed += other.failed
        self.replies += other.replies
        self.cut_at_length += other.cut_at_length
        self.generated_tokens += other.generated_tokens

    def attempted(self) -> int:
        return self.written + self.failed

    def summary(self) -> dict:
        """The counts, for summary.json (and so the run record)."""
        return {
            "already_done": self.already_done,
            "written": self.written,
            "failed": self.failed,
            "replies": self.replies,
            "cut_at_length": self.cut_at_length,
            "generated_tokens": self.generated_tokens,
            "skipped": dict(self.skipped.counts),
        }

    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(time.monotonic() - self.started, 1e-9)

    def lines(self) -> list[str]:
        out = [
            f"already in output    {self.already_done}",
            f"written              {self.written} conversations, {self.replies} replies "
            f"({self.cut_at_length} cut at max_new_tokens)",
            f"generated            {self.generated_tokens} reply tokens, {self.tokens_per_s():.0f} tokens/s",
            f"failed (rerun)       {self.failed}",
            f"skipped input        {self.skipped.total} {self.skipped.counts or ''}",
        ]
        return out + [f"  {example}" for example in self.skipped.examples]


def finished_sources(output: Path) -> set[str]:
    """Keys already written (source digests; the "file:line" source of lines an older dflash
    wrote); truncates a torn last line (a crash mid-write) away."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        log.warning(
            "regen: %s ends in a torn line (%d bytes); dropping it", output, len(data) - len(complete)
        )
        with output.open("r+b") as handle:
            handle.truncate(len(complete))
    done = set()
    for line_no, line in enumerate(complete.decode(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            done.add(record.get("source_digest", record["source"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "no source or source_digest"
            raise ValueError(
                f"{output}:{line_no}: not a record dflash regen wrote ({reason}); regen.output is read "
                "to skip finished conversations: fix or remove that line, or write another output"
            ) from exc
    return done


def _unfinished(
    conversations: Iterator[Conversation], done: set[str], skipped: SkipReport
) -> Iterator[Conversation]:
    for conversation in drop_repeats(conversations, skipped):
        if conversation_digest(conversation) in done or conversation.source in done:
            continue
        if not any(m["role"] == "user" for m in conversation.messages):
            skipped.add("no_user_turn", conversation.source, "no user turn to answer")
            continue
        yield conversation


class ConversationTurns:
    """One conversation being rewritten: hands out the prompt of its next reply (the
    conversation so far, earlier replies already the target's) and takes the reply."""

    def __init__(self, conversation: Conversation):
        self.conversation = conversation
        self.pending = list(conversation.messages)
        self.done: list[dict[str, str]] = []
        self.finishes: list[str] = []
        self.failed = False

    def next_prompt(self) -> list[dict[str, str]] | None:
        """The prompt of the next reply, or None when the conversation is finished (or failed)."""
        # Move turns into `done` up to the next assistant turn that answers a user turn; its
        # original text is dropped and the target's reply takes its place.
        while self.pending and not self.failed:
            message = self.pending.pop(0)
            if message["role"] == "assistant" and self.done and self.done[-1]["role"] == "user":
                return list(self.done)
            self.done.append(message)
        return None

    def answer(self, reply: Reply | None, stats: RegenStats) -> None:
        if reply is None:
            self.failed = True
            return
        self.done.append({"role": "assistant", "content": reply.text})
        self.finishes.append(reply.finish_reason)
        stats.replies += 1
        stats.cut_at_length += reply.finish_reason == "length"
        stats.generated_tokens += reply.tokens

    def record(self, backend: RegenBackend, stats: RegenStats) -> dict | None:
        """The output line, or None (counted as failed) when a reply failed."""
        if self.failed:
            stats.failed += 1
            log.warning(
                "regen: %s not written (a reply failed); a rerun retries it", self.conversation.source
            )
            return None
        messages = self.done
        # Trailing turns after the last reply (a final user turn) carry no supervision: dropped.
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        return {
            **self.conversation.extra,
            "messages": messages,
            "source": self.conversation.source,
            "source_digest": conversation_digest(self.conversation),
            "regen": {
                "backend": backend.name,
                "sampling": backend.describe(),
                "finish_reasons": self.finishes,
            },
        }


def regenerate_batch(
    backend: RegenBackend, batch: list[Conversation], stats: RegenStats
) -> list[dict | None]:
    """Each conversation with its assistant turns replaced, or None if a request failed; the
    batch goes turn by turn (every conversation's k-th reply in one generate call)."""
    turns = [ConversationTurns(c) for c in batch]
    while True:
        asking = [(t, prompt) for t in turns if (prompt := t.next_prompt()) is not None]
        if not asking:
            break
        for (conversation, _), reply in zip(asking, backend.generate([p for _, p in asking])):
            conversation.answer(reply, stats)
    return [t.record(backend, stats) for t in turns]


def _continuous(backend, todo: Iterator[Conversation], write: _Writer, stats: RegenStats) -> None:
    """In-process continuous batching: every conversation's next prompt is queued as soon as its
    previous reply is done; enough conversations stay open that a freed slot never waits."""
    open_limit = 2 * backend.batcher.slots
    opened = 0

    def ask(conversation: ConversationTurns) -> None:
        nonlocal opened
        while True:
            prompt = conversation.next_prompt()
            if prompt is None:
                opened -= 1
                write([conversation.record(backend, stats)])
                return
            if backend.submit(conversation, prompt):
                return
            conversation.answer(None, stats)

    backend.batcher.reset()  # nothing left over from an interrupted earlier run
    while True:
        while opened < open_limit:
            fresh = next(todo, None)
            if fresh is None:
                break
            opened += 1
            ask(ConversationTurns(fresh))
        if not backend.batcher.busy:
            break
        for conversation, reply in backend.poll():
            conversation.answer(reply, stats)
            ask(conversation)
        write.progress.set_postfix(tok_s=f"{stats.tokens_per_s():.0f}", refresh=False)


def refuse_output_among_inputs(inputs: list[str], output: Path) -> None:
    """The output must never be read as an input: regen appends to it while reading the inputs,
    so it would answer its own lines again, without end (200 conversations became 10,389 lines
    in 40 s). The rule is the input reader's own (`entry_reads`), whether or not it exists yet."""
    for entry in inputs:
        if entry_reads(entry, output):
            raise ValueError(
                f"regen.output={output} would be read as an input (regen.input entry {entry!r}): "
                "regen would answer its own output again without end; write it outside the inputs"
            )


def regenerate(
    backend: RegenBackend,
    inputs: list[str],
    output: Path,
    batch_size: int,
    limit: int | None = None,
    stats: RegenStats | None = None,
    layout: RecordLayout = AUTO_LAYOUT,
) -> RegenStats:
    """Answers every unfinished conversation of `inputs` into `output`; one process per output
    (a second one is refused while the first lives: both would write every conversation).
    `stats`: counted into as it goes (what an interrupted run had done stays readable)."""
    refuse_output_among_inputs(inputs, output)
    lock = FileLock(
        output.with_name(f".{output.name}.lock"),
        lambda holder: ValueError(
            f"regen.output={output} is being written by another dflash regen ({holder}); "
            "wait for it, or write another output"
        ),
    )
    with lock:
        return _regenerate(backend, inputs, output, batch_size, limit, stats or RegenStats(), layout)


def _regenerate(
    backend: RegenBackend,
    inputs: list[str],
    output: Path,
    batch_size: int,
    limit: int | None,
    stats: RegenStats,
    layout: RecordLayout,
) -> RegenStats:
    done = finished_sources(output)
    stats.already_done = len(done)
    todo = _unfinished(read_conversations(inputs, stats.skipped, "regen.input", layout), done, stats.skipped)
    if limit is not None:
        todo = itertools.islice(todo, max(0, limit - len(done)))
    with output.open("a", encoding="utf-8") as handle:
        write = _Writer(handle, stats)
        try:
            if backend.conversations_in_flight:
                _stream(backend, todo, batch_size, write, stats)
            elif getattr(backend, "continuous", False):
                _continuous(backend, todo, write, stats)
            else:
                for batch in chunked(todo, batch_size):
                    write(regenerate_batch(backend, batch, stats))
        finally:  # what was written stays written, also when interrupted
            write.close()
    return stats


class _Writer:
    """Appends finished conversations, one whole line each, flushed at once (a crash loses at
    most a torn last line, which the next run drops) and fsynced every few seconds."""

    def __init__(self, handle, stats: RegenStats, sync_every_s: float = 5.0):
        from tqdm import tqdm

        self.handle, self.stats, self.sync_every_s = handle, stats, sync_every_s
        self.last_sync = time.monotonic()
        self.progress = tqdm(desc="dflash regen", unit="conv", initial=stats.already_done, mininterval=2.0)

    def __call__(self, records: list[dict | None]) -> None:
        with self._naming_the_output():
            self._write(records)

    @contextmanager
    def _naming_the_output(self):
        """A full disk, a quota, a vanished mount: one line naming the output (a write error
        carries no path); what was written before stays, and a rerun continues after it."""
        try:
            yield
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"writing regen.output={self.handle.name} failed ({exc.strerror or exc}); the "
                f"{self.stats.written} conversations written before stay, and rerunning the same "
                "command continues after them",
            ) from exc

    def _write(self, records: list[dict | None]) -> None:
        for record in records:
            if record is not None:
                self.handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                self.stats.written += 1
                self.progress.update()
        self.handle.flush()
        self.progress.set_postfix(failed=self.stats.failed, refresh=False)
        if time.monotonic() - self.last_sync > self.sync_every_s:
            self.sync()

    def sync(self) -> None:
        os.fsync(self.handle.fileno())
        self.last_sync = time.monotonic()

    def close(self) -> None:
        self.progress.close()
        with self._naming_the_output():
            self.sync()


def _stream(
    backend: RegenBackend, todo: Iterator[Conversation], in_flight: int, write: _Writer, stats: RegenStats
) -> None:
    """A server backend: `in_flight` conversations at a time, each through its own turns, a new
    one started as soon as one finishes (no batch waits for its slowest conversation)."""
    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="dflash-regen") as pool:
        running: dict[Future, RegenStats] = {}

        def submit(conversation: Conversation) -> None:
            own = RegenStats()  # per task, merged on this thread: no shared counters
            running[pool.submit(regenerate_batch, backend, [conversation], own)] = own

        for conversation in itertools.islice(todo, in_flight):
            submit(conversation)
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                stats.add(running.pop(future))
                write(future.result())
                for conversation in itertools.islice(todo, 1):
                    submit(conversation)
