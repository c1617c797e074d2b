"""A small OpenAI-compatible chat server for tests: a real HTTP server on 127.0.0.1 (in a
thread) that streams its answer as server-sent events, the way llama-server does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class ServerLog:
    """What the server saw: request bodies, start/end events in order, peak concurrency."""

    bodies: list[dict] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)  # each request's Authorization header
    events: list[str] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    barrier: threading.Barrier | None = None  # the first requests wait here for each other
    fail_every: int = 0  # answer every n-th request with HTTP 500


def answer_words(body: dict) -> list[str]:
    """The server's deterministic answer: one word per token, from the user's question."""
    question = body["messages"][-1]["content"]
    n = int(body.get("max_tokens", 6))
    words = (question.split() * 10)[:n]
    return [w + " " for w in words]


def prompt_tokens(body: dict) -> int:
    return sum(len(m["content"].split()) for m in body["messages"])


def _handler(log: ServerLog) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with log.lock:
                log.bodies.append(body)
                log.auth.append(self.headers.get("Authorization"))
                k = len(log.bodies)
                log.in_flight += 1
                log.peak = max(log.peak, log.in_flight)
                log.events.append("start")
            if log.barrier is not None and k <= log.barrier.parties:
                log.barrier.wait(timeout=20)
            if log.fail_every and k % log.fail_every == 0:
                self._done()
                self.send_response(500)
                self.end_headers()
                self.wfile.write(b"overloaded")
                return
            self._stream(body)

        def _done(self) -> None:
            """Logged before the last write, so the client cannot be done before the log is."""
            with log.lock:
                log.in_flight -= 1
                log.events.append("end")

        def _send(self, obj: object) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def _stream(self, body: dict) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            words = answer_words(body)
            self._send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for w in words:
                self._send({"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]})
            reason = "length" if len(words) == body.get("max_tokens") else "stop"
            self._send({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})
            usage = {"prompt_tokens": prompt_tokens(body), "completion_tokens": len(words)}
            self._send({"choices": [], "usage": usage})
            self._done()
            self._send("[DONE]")

    return Handler


@contextmanager
def sse_server(log: ServerLog) -> Iterator[str]:
    """Serves until the block ends; yields the base URL (http://127.0.0.1:PORT)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(log))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
