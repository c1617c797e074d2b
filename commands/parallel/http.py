"""llama-parallel's client simulation against a server: n client threads send the same kind of
requests to an OpenAI-compatible /v1/chat/completions endpoint and read the streamed (SSE)
answers. Standard library only (http.client + threads)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtool import KvtoolError
from kvtool.commands.parallel.prompts import pick_requests
from kvtool.commands.parallel.sim import ClientStatus, ParallelParams, ParallelSummary, RequestRecord


class ServerError(KvtoolError):
    """The endpoint could not be reached or answered with an error."""


def check_server(url: str, timeout: float) -> None:
    """Refuses, before any client starts, a URL that is not http(s)://HOST[:PORT][/PATH] or a
    server that takes no connection (ServerError, one line)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ServerError(f"--server {url}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ServerError(f"--server {url}: expected http://HOST[:PORT][/v1] (or https://)")
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=min(timeout, 10.0)).close()
    except OSError as e:
        raise ServerError(
            f"--server {url}: cannot connect to {parts.hostname}:{port} ({e.strerror or e})"
        ) from None


def chat_url(url: str) -> str:
    """The chat completions URL for a server base URL (".../v1" or a full endpoint also work)."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def stream_chat(
    url: str, payload: dict[str, object], timeout: float, api_key: str | None = None
) -> Iterator[dict[str, object]]:
    """POSTs a streaming chat request (with `api_key` as a Bearer token, as llama-server's
    --api-key asks) and yields each `data:` JSON chunk until [DONE]."""
    parts = urlsplit(chat_url(url))
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        body = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request("POST", parts.path or "/", body=body, headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise ServerError(f"HTTP {resp.status} {resp.reason}: {resp.read(500).decode(errors='replace')}")
        while True:
            line = resp.readline()
            if not line:
                return
            text = line.decode("utf-8", errors="replace").strip()
            if not text.startswith("data:"):
                continue  # blank separators, comments, event names
            data = text[5:].strip()
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"server error: {chunk['error']}")
            yield chunk
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        raise ServerError(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()


@dataclass
class _Slot:
    seq: int = -1
    n_decoded: int = 0
    started: bool = False


class HttpParallelSim:
    """The same clients and requests as ParallelSim, served by a remote endpoint. Prompt token
    counts come from the server's usage report (-1 when it sends none); the answer length is
    usage.completion_tokens, else the number of content chunks."""

    def __init__(
        self,
        url: str,
        params: ParallelParams,
        model: str = "",
        timeout: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url
        self.p = params
        self.model = model
        self.timeout = timeout
        self.api_key = api_key
        self.records: list[RequestRecord] = []
        self.n_cache_miss = 0  # a server does not report these
        self.n_tokens = 0
        self.t0 = time.perf_counter()
        self._slots = [_Slot() for _ in range(params.n_clients)]
        self._requests = pick_requests(params.prompts, params.n_sequences, params.n_junk, params.prompt_seed)
        self._next = 0
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def status(self) -> list[ClientStatus]:
        return [
            ClientStatus(i, s.seq, "idle" if s.seq < 0 else "gen" if s.started else "prompt", s.n_decoded)
            for i, s in enumerate(self._slots)
        ]

    def payload(self, seq: int) -> dict[str, object]:
        """The request body of request `seq`: the system transcript, any junk turns, the question."""
        question, _, junk = self._requests[seq]
        messages = [{"role": "system", "content": self.p.system}]
        for q, a in junk:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": question})
        sp = self.p.sampler
        body: dict[str, object] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": max(sp.temp, 0.0),
            "top_p": sp.top_p,
        }
        if self.p.n_predict > 0:
            body["max_tokens"] = self.p.n_predict
        if sp.seed >= 0:
            body["seed"] = sp.seed
        return body

    def _serve(self, client: int, seq: int, on_finish: Callable[[RequestRecord], None] | None) -> None:
        slot = self._slots[client]
        slot.seq, slot.n_decoded, slot.started = seq, 0, False
        t_start, ttft = self.now(), None
        text, finish, error = "", "length", ""
        usage: dict[str, Any] = {}
        try:
            for chunk in stream_chat(self.url, self.payload(seq), self.timeout, self.api_key):
                usage = chunk.get("usage") or usage  # type: ignore[assignment]
                choices: list[dict[str, Any]] = chunk.get("choices") or []  # type: ignore[assignment]
                for choice in choices:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        ttft = self.now() - t_start if ttft is None else ttft
                        slot.started = True
                        slot.n_decoded += 1
                        with self._lock:
                            self.n_tokens += 1
                        text += piece
                    finish = choice.get("finish_reason") or finish
        except Exception as e:  # a worker thread records its failure instead of dying silently
            finish, error = "error", str(e) if isinstance(e, ServerError) else f"{type(e).__name__}: {e}"
        n_prompt = int(usage.get("prompt_tokens", -1)) if usage else -1
        n_gen = int(usage.get("completion_tokens", slot.n_decoded)) if usage else slot.n_decoded
        stop = {"stop": "eog", "length": "length"}.get(finish, finish)
        rec = RequestRecord(
            client,
            seq,
            self._requests[seq][1],
            n_prompt,
            n_gen,
            t_start,
            self.now(),
            0,
            stop,
            self._requests[seq][0],
            error or text.strip(),
            ttft,
        )
        slot.seq = -1
        with self._lock:  # also keeps the callbacks of different threads apart
            self.records.append(rec)
            if n_prompt > 0:
                self.n_tokens += n_prompt
            if on_finish is not None:
                on_finish(rec)

    def _client_loop(self, client: int, on_finish: Callable[[RequestRecord], None] | None) -> None:
        """Continuous batching from the client side: take the next request as soon as one ends."""
        while True:
            with self._lock:
                if self._next >= self.p.n_sequences:
                    return
                seq, self._next = self._next, self._next + 1
            self._serve(client, seq, on_finish)

    def run(self, on_finish: Callable[[RequestRecord], None] | None = None) -> ParallelSummary:
        """Sends every request and waits for all answers; failed requests are recorded with
        stop = "error" (their message in `response`)."""
        self.t0 = time.perf_counter()
        if self.p.cont_batching:
            waves = [
                [
                    threading.Thread(target=self._client_loop, args=(c, on_finish), daemon=True)
                    for c in range(self.p.n_clients)
                ]
            ]
        else:  # waves: the next n_clients requests start when the whole previous wave is done
            waves = []
            for first in range(0, self.p.n_sequences, self.p.n_clients):
                seqs = range(first, min(first + self.p.n_clients, self.p.n_sequences))
                waves.append(
                    [
                        threading.Thread(target=self._serve, args=(c, s, on_finish), daemon=True)
                        for c, s in enumerate(seqs)
                    ]
                )
        for wave in waves:
            for t in wave:
                t.start()
            for t in wave:
                t.join()
        ok = [r for r in self.records if r.stop != "error"]
        return ParallelSummary(
            self.p.n_clients,
            self.p.n_sequences,
            self.p.cont_batching,
            -1,
            sum(max(r.n_prompt, 0) for r in ok),
            sum(r.n_decoded for r in ok),
            self.now(),
            0,
            sorted(self.records, key=lambda r: r.seq),
        )
