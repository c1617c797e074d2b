"""The HTTP side of `kvtool serve` on Starlette: llama-server's routes, its API key check, a
body size limit and a bounded queue. Handlers never touch the context: they submit tasks to
the engine's thread and read their events; a client that goes away cancels its task at once."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import kvtool
from kvtool.commands.serve import api
from kvtool.commands.serve.loop import EngineLoop, TaskFailed, TaskStream
from kvtool.common.task import Request, Task, TokenOut

MAX_BODY = 16 << 20  # bytes of one request body
PUBLIC = ("/health", "/v1/health")  # answered without the API key, as llama-server's


@dataclass
class ServeParams:
    """What the command line decided about the HTTP side."""

    model_names: tuple[str, ...]  # the names a request's `model` may give; the first is reported
    api_keys: tuple[str, ...] = ()
    max_queue: int = 64
    timeout: float = 600.0
    metrics: bool = False
    slots: bool = True
    cache_prompt: bool = True
    slot_save_path: Path | None = None  # the folder of POST /slots/{id}?action=save|restore


class Server:
    """The routes' shared state: the model, the engine loop, the limits."""

    def __init__(self, model: kvtool.Model, loop: EngineLoop, p: ServeParams) -> None:
        self.model = model
        self.loop = loop
        self.p = p
        sched = loop.sched
        self.limits = api.Limits(sched.ctx.n_ctx_seq, p.cache_prompt, sched.p.n_slots)
        self.n_tasks = 0

    # -- helpers -----------------------------------------------------------------------------
    async def body(self, request: HttpRequest) -> dict[str, Any]:
        size = int(request.headers.get("content-length") or 0)
        if size > MAX_BODY:
            raise api.ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > MAX_BODY:
                raise api.ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB")
            chunks.append(chunk)
        return api.parse_json(b"".join(chunks))

    def check_model(self, body: dict[str, Any]) -> str:
        """The model name a response gives. As llama-server with one model, any name a request
        asks for is served by this model (clients send placeholders such as "gpt-4o"); one of
        this model's names is echoed, any other gets the first."""
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise api.ApiError(400, f"'model' must be a string, got {type(name).__name__}")
        return name if name in self.p.model_names else self.p.model_names[0]

    def submit(self, req: Request) -> tuple[Task, TaskStream]:
        sched = self.loop.sched
        if sched.n_queued(extra=1) > self.p.max_queue:
            raise api.ApiError(
                503, "the server is busy: every slot is taken and the queue is full", "unavailable_error"
            )
        stream = TaskStream(asyncio.get_running_loop())
        try:
            task = sched.submit(req, stream)
        except (kvtool.KvtoolError, ValueError) as e:
            raise api.bad(str(e)) from None
        self.n_tasks += 1
        return task, stream

    async def collect(self, receive: Receive, task: Task, stream: TaskStream) -> list[TokenOut]:
        """Every token of a task, cancelling it if the client goes away or the deadline passes."""
        outs: list[TokenOut] = []

        async def run() -> None:
            async for out in stream.tokens(task):
                outs.append(out)

        await _guarded(receive, task, run(), self.p.timeout)
        return outs


async def _guarded(receive: Receive, task: Task, work: Awaitable[None], timeout: float) -> None:
    """Runs `work`; a disconnect cancels the task at once, and so does the deadline (then 408)."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait_for(work, timeout)
    except asyncio.TimeoutError:
        task.cancel()
        raise api.ApiError(
            408, f"the request took longer than --timeout {timeout:g} s", "timeout_error"
        ) from None
    except TaskFailed as e:
        raise api.ApiError(500, str(e), "server_error") from None
    finally:
        watcher.cancel()
        task.cancel()  # nothing if it ended


class EventStream(Response):
    """Server-sent events from an async iterator of JSON documents; `data: [DONE]` closes OpenAI
    streams. The task is cancelled when the client disconnects, or at the deadline."""

    HEADERS: ClassVar[list[tuple[bytes, bytes]]] = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
    ]

    def __init__(self, events: AsyncIterator[dict[str, Any]], task: Task, timeout: float, done: bool) -> None:
        self.events, self.task, self.timeout, self.done = events, task, timeout, done
        self.status_code = 200
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.HEADERS})

        async def pump() -> None:
            async for doc in self.events:
                await send({"type": "http.response.body", "body": _sse(doc), "more_body": True})

        try:
            await _guarded(receive, self.task, pump(), self.timeout)
        except api.ApiError as e:
            await send({"type": "http.response.body", "body": _sse(e.body()), "more_body": True})
        except OSError:
            return  # the client is gone: nothing more to write
        tail = b"data: [DONE]\n\n" if self.done else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, ensure_ascii=False).encode() + b"\n\n"


def _error(e: api.ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


Handler = Callable[[Server, HttpRequest], Awaitable[Response]]


def _route(path: str, handler: Handler, server: Server, methods: list[str]) -> Route:
    async def endpoint(request: HttpRequest) -> Response:
        try:
            return await handler(server, request)
        except api.ApiError as e:
            return _error(e)

    return Route(path, endpoint, methods=methods)


class ApiKey:
    """llama-server's check: `Authorization: Bearer KEY` or `X-Api-Key: KEY`, compared in constant
    time, on every path but /health."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in PUBLIC:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization") or headers.get(b"x-api-key") or b""
        given = given.removeprefix(b"Bearer ")
        ok = False
        for k in self.keys:  # every key is compared, so the time says nothing about which matched
            ok |= hmac.compare_digest(given, k)
        if ok:
            return await self.app(scope, receive, send)
        err = api.ApiError(401, "Invalid API Key", "authentication_error")
        await _error(err)(scope, receive, send)


class EndsQuietly:
    """A forced stop (Ctrl-C again) cancels the requests in flight: each response ends where
    it is (a stream's body closed after its last whole event, one not begun a 503), instead
    of uvicorn logging the cancellation as a traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = {"started": False, "done": False}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if scope["type"] != "http" or state["done"]:
                return
            with contextlib.suppress(Exception):  # the connection may be gone already
                if not state["started"]:
                    body = json.dumps(api.ApiError(503, "the server is stopping", "unavailable_error").body())
                    headers = [(b"content-type", b"application/json")]
                    await send({"type": "http.response.start", "status": 503, "headers": headers})
                    await send({"type": "http.response.body", "body": body.encode(), "more_body": False})
                else:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_app(server: Server, routes: list[tuple[str, Handler, list[str]]]) -> ASGIApp:
    app = Starlette(routes=[_route(p, h, server, m) for p, h, m in routes])

    async def not_found(request: HttpRequest, exc: Exception) -> Response:
        return _error(api.ApiError(404, f"File Not Found: {request.url.path}", "not_found_error"))

    async def not_allowed(request: HttpRequest, exc: Exception) -> Response:
        return _error(api.ApiError(405, f"method {request.method} is not allowed on {request.url.path}"))

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_allowed)
    return EndsQuietly(ApiKey(app, server.p.api_keys))
