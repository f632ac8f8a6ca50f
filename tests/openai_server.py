"""A small OpenAI-compatible chat-completions server on loopback, serving a regen backend.

Enough of the protocol for `openai.OpenAI` (GET /v1/models, POST /v1/chat/completions), plus
fault injection: the first `fail_first` completion requests answer 503, any request whose
last message contains `poison` answers 500 every time, and one whose last message contains a
key of `bad_answers` gets that (content type, body) with status 200 (an answer that is no
reply). `delay_s` slows every completion; `authorizations` records each request's header.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL_NAME = "tiny-chat"


class LoopbackChatServer:
    def __init__(
        self,
        backend,
        fail_first: int = 0,
        poison: str = "POISON",
        bad_answers: dict[str, tuple[str, bytes]] | None = None,
        delay_s: float = 0.0,
    ):
        self.backend, self.fail_first, self.poison = backend, fail_first, poison
        self.bad_answers, self.delay_s = dict(bad_answers or {}), delay_s
        self.authorizations: list[str] = []
        self.lock = threading.Lock()
        self.requests = 0
        self.active = 0  # requests being handled right now
        self.max_active = 0
        self.active_lock = threading.Lock()
        self.served: list[tuple[list[dict], str]] = []  # (messages, reply) of each success
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "tests"}]})  # fmt: skip
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                with server.active_lock:
                    server.active += 1
                    server.max_active = max(server.max_active, server.active)
                try:
                    self._complete()
                finally:
                    with server.active_lock:
                        server.active -= 1

            def _raw(self, content_type: str, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _complete(self):
                length = int(self.headers.get("Content-Length", 0))
                request = json.loads(self.rfile.read(length))
                time.sleep(server.delay_s)
                with server.lock:  # one generation at a time; requests queue here
                    server.requests += 1
                    server.authorizations.append(self.headers.get("Authorization", ""))
                    last = request["messages"][-1]["content"]
                    bad = next((answer for key, answer in server.bad_answers.items() if key in last), None)
                    if bad is not None:
                        self._raw(*bad)
                        return
                    if server.requests <= server.fail_first:
                        self._send(503, {"error": {"message": "warming up", "type": "unavailable"}})
                        return
                    messages = request["messages"]
                    if server.poison in messages[-1]["content"]:
                        self._send(500, {"error": {"message": "poisoned prompt", "type": "server_error"}})
                        return
                    reply = server.backend.generate([messages])[0]
                    server.served.append((messages, reply.text))
                self._send(
                    200,
                    {
                        "id": f"chatcmpl-{server.requests}",
                        "object": "chat.completion",
                        "created": 0,
                        "model": request.get("model", MODEL_NAME),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": reply.text},
                                "finish_reason": reply.finish_reason,
                            }
                        ],
                        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="loopback-chat", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> LoopbackChatServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)
