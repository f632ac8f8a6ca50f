"""`llama-server` with a target and a drafter, on 127.0.0.1 only, asked for one greedy completion
of given token ids at a time.

What a request reports and how it is read (the pinned source, tools/server/): `timings.draft_n` /
`timings.draft_n_accepted` per request; the verification steps and the accepted drafts per draft
position only as the server's cumulative counters at GET /metrics (`--metrics`), added when a
request finishes. Requests go one at a time and the counters are read before and after each, so
each difference is that request's.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash.serving.llamacpp import LlamaCppBuild

# The server's start (loading two GGUF files, a warm-up decode) on a loaded 2-core machine.
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 1800


@dataclass
class ServedDecode:
    """One greedy completion as the server reports it."""

    output_ids: list[int]
    drafted: int  # draft tokens proposed (timings.draft_n)
    accepted: int  # of those, accepted (timings.draft_n_accepted)
    verifications: int  # target verification steps of a draft (/metrics difference)
    accepted_per_position: list[int] = field(default_factory=list)  # rounds accepting position i
    tokens_per_s: float = 0.0  # timings.predicted_per_second


_COUNTER = re.compile(r'^llamacpp:(\w+)(?:\{position="(\d+)"\})? (\S+)$', re.M)


def speculation_counters(text: str) -> dict[str, float]:
    """The speculative-decoding counters of a /metrics page (per position as `name/i`)."""
    counters = {}
    for name, position, value in _COUNTER.findall(text):
        if name.startswith("spec_decode_"):
            counters[name if not position else f"{name}/{position}"] = float(value)
    return counters


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """`llama-server` with a target and a drafter, on 127.0.0.1 only, one request at a time.

    `draft_max`: tokens drafted per round, passed as `--spec-draft-n-max` (the server's default is
    3 whatever the drafter's block: B-1 for DFlash and DFlash2, B for DSpark's anchor-first
    block); `spec_type`: draft-dflash (DFlash, DFlash2) or draft-dspark."""

    def __init__(
        self,
        build: LlamaCppBuild,
        *,
        target_gguf: Path,
        drafter_gguf: Path,
        spec_type: str,
        draft_max: int,
        context: int,
        threads: int,
        log_path: Path,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            str(build.server),
            *("-m", str(target_gguf), "-md", str(drafter_gguf)),
            *("--spec-type", spec_type, "--spec-draft-n-max", str(draft_max)),
            *("--host", "127.0.0.1", "--port", str(self.port), "--metrics"),
            *("-np", "1", "-c", str(context), "-t", str(threads), "-tb", str(threads)),
            *("-td", str(threads), "-tbd", str(threads)),
        ]
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = " | ".join(Path(self.log_path).read_text().strip().splitlines()[-3:])
                raise ValueError(
                    f"llama-server exited ({self.process.returncode}): {tail} (log: {self.log_path})"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server not ready after {START_TIMEOUT_S} s (log: {self.log_path})")

    def _counters(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=60) as reply:
            return speculation_counters(reply.read().decode())

    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> ServedDecode:
        """One greedy completion of `prompt_ids` (no prompt cache: every request prefills)."""
        before = self._counters()
        body = {
            "prompt": list(prompt_ids),
            "n_predict": max_new_tokens,
            "temperature": 0.0,
            "cache_prompt": False,
            "return_tokens": True,
        }
        request = urllib.request.Request(
            f"{self.url}/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            answer = json.loads(reply.read())
        after = self._counters()
        timings = answer.get("timings", {})
        delta = {key: after[key] - before.get(key, 0.0) for key in after}
        positions = sorted((int(key.rsplit("/", 1)[1]), value) for key, value in delta.items() if "/" in key)
        return ServedDecode(
            output_ids=list(answer["tokens"]),
            drafted=int(timings.get("draft_n", 0)),
            accepted=int(timings.get("draft_n_accepted", 0)),
            verifications=int(delta.get("spec_decode_num_drafts_total", 0)),
            accepted_per_position=[int(value) for _, value in positions],
            tokens_per_s=float(timings.get("predicted_per_second", 0.0)),
        )

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
