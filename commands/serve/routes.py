"""llama-server's endpoints: each reads its body, submits a task or asks the engine's thread for
a snapshot, and answers in llama-server's shapes (commands/serve/shapes.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

import kvtool
from kvtool.commands.serve import api, ledger, shapes
from kvtool.commands.serve.app import EventStream, Handler, Server
from kvtool.commands.serve.loop import TaskStream
from kvtool.commands.serve.slot_actions import slot_action
from kvtool.common.task import Task


async def health(s: Server, r: HttpRequest) -> Response:
    return JSONResponse({"status": "ok"})


def _model_info(s: Server) -> dict[str, Any]:
    m = s.model
    return {
        "id": s.p.model_names[0],
        "aliases": list(s.p.model_names[1:]),
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kvtool",
        "meta": {
            "n_vocab": m.n_vocab,
            "n_ctx": s.limits.n_ctx_slot,
            "n_ctx_train": m.n_ctx_train,
            "n_params": m.n_params(),
            "size": m.size_bytes(),
        },
    }


async def models(s: Server, r: HttpRequest) -> Response:
    return JSONResponse({"object": "list", "data": [_model_info(s)]})


async def props(s: Server, r: HttpRequest) -> Response:
    m = s.model
    bos, eos = m.vocab.bos, m.vocab.eos
    return JSONResponse(
        {
            "default_generation_settings": {
                "n_ctx": s.limits.n_ctx_slot,
                "params": {"cache_prompt": s.p.cache_prompt},
            },
            "total_slots": s.limits.n_slots,
            "model_alias": s.p.model_names[0],
            "model_path": str(m.path),
            "modalities": {"vision": False, "audio": False},
            "endpoint_slots": s.p.slots,
            "endpoint_metrics": s.p.metrics,
            "chat_template": m.chat_template.source,
            "bos_token": m.vocab.token_text(bos) if bos is not None and bos >= 0 else "",
            "eos_token": m.vocab.token_text(eos) if eos is not None and eos >= 0 else "",
            "build_info": "kvtool",
        }
    )


async def tokenize(s: Server, r: HttpRequest) -> Response:
    body = await s.body(r)
    content = body.get("content", "")
    if not isinstance(content, str):
        raise api.bad("'content' must be a string")
    ids = s.model.tokenize(
        content,
        add_special=api.flag(body, "add_special", False),
        parse_special=api.flag(body, "parse_special", True),
    )
    if not api.flag(body, "with_pieces", False):
        return JSONResponse({"tokens": ids})
    out = []
    for t in ids:
        piece = s.model.token_to_piece(t, special=True)
        try:
            text: Any = piece.decode("utf-8")
        except UnicodeDecodeError:
            text = list(piece)
        out.append({"id": t, "piece": text})
    return JSONResponse({"tokens": out})


async def detokenize(s: Server, r: HttpRequest) -> Response:
    body = await s.body(r)
    ids = body.get("tokens", [])
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise api.bad("'tokens' must be a list of token ids")
    if any(not 0 <= t < s.model.n_vocab for t in ids):
        raise api.bad(f"a token id is out of the vocabulary (n_vocab = {s.model.n_vocab})")
    return JSONResponse({"content": s.model.detokenize(ids, special=True)})


async def slots(s: Server, r: HttpRequest) -> Response:
    if not s.p.slots:
        raise api.ApiError(501, "This server does not support slots endpoint.", "not_supported_error")
    snap = await asyncio.wrap_future(s.loop.call(lambda: ledger.snapshot(s.loop.sched)))
    return JSONResponse(snap.slots)


async def metrics(s: Server, r: HttpRequest) -> Response:
    if not s.p.metrics:
        raise api.ApiError(501, "This server does not support metrics endpoint.", "not_supported_error")
    snap = await asyncio.wrap_future(s.loop.call(lambda: ledger.snapshot(s.loop.sched)))
    return Response(ledger.metrics_text(snap), media_type="text/plain; version=0.0.4")


def _chat_tokens(s: Server, body: dict[str, Any]) -> list[int]:
    msgs = api.messages(body)
    try:
        text = s.model.apply_chat_template(msgs, add_generation_prompt=True)
    except kvtool.KvtoolError as e:
        raise api.bad(f"the chat template failed: {e}") from None
    return s.model.tokenize(text, add_special=True, parse_special=True)


async def chat(s: Server, r: HttpRequest) -> Response:
    body = await s.body(r)
    name = s.check_model(body)
    req = api.generation(body, _chat_tokens(s, body), s.limits, chat=True)
    task, stream = s.submit(req)
    head = shapes.Head.new("chatcmpl", name, s.n_tasks)
    if not api.flag(body, "stream", False):
        outs = await s.collect(r.receive, task, stream)
        return JSONResponse(shapes.chat(head, task, outs))
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and opts.get("include_usage") is True

    async def events() -> AsyncIterator[dict[str, Any]]:
        first = True
        async for out in stream.tokens(task):
            lp = shapes.logprobs([out])
            if first or out.text or lp:
                delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
                if out.text:
                    delta["content"] = out.text
                yield shapes.chat_chunk(head, delta, lp=lp)
                first = False
        if rest := task.rest():
            yield shapes.chat_chunk(head, {"content": rest})
        for doc in shapes.chat_tail(head, task, include_usage):
            yield doc

    return EventStream(events(), task, s.p.timeout, done=True)


async def _text_task(s: Server, r: HttpRequest, openai: bool) -> tuple[dict[str, Any], str, Task, TaskStream]:
    """The body, the model name and the submitted task of a text completion (`openai`: of
    /v1/completions, which refuses OpenAI's fields that llama-server refuses)."""
    body = await s.body(r)
    if openai:
        api.openai_completion(body)
    name = s.check_model(body)
    task, stream = s.submit(api.generation(body, api.prompt_tokens(s.model, body), s.limits, chat=False))
    return body, name, task, stream


async def completions(s: Server, r: HttpRequest) -> Response:
    """OpenAI's /v1/completions."""
    body, name, task, stream = await _text_task(s, r, openai=True)
    head = shapes.Head.new("cmpl", name, s.n_tasks)
    if not api.flag(body, "stream", False):
        outs = await s.collect(r.receive, task, stream)
        return JSONResponse(shapes.text_completion(head, task, task.text, outs, final=True))

    async def events() -> AsyncIterator[dict[str, Any]]:
        async for out in stream.tokens(task):
            if out.text or out.prob:
                yield shapes.text_completion(head, task, out.text, [out], final=False)
        yield shapes.text_completion(head, task, task.rest(), [], final=True)

    return EventStream(events(), task, s.p.timeout, done=True)


async def completion(s: Server, r: HttpRequest) -> Response:
    """llama.cpp's native /completion (cache_prompt, n_predict, id_slot...)."""
    body, name, task, stream = await _text_task(s, r, openai=False)
    prompt = (
        body["prompt"]
        if isinstance(body.get("prompt"), str)
        else s.model.detokenize(task.req.tokens, special=True)
    )
    if not api.flag(body, "stream", False):
        outs = await s.collect(r.receive, task, stream)
        return JSONResponse(shapes.native_final(task, name, outs, task.text, prompt))

    async def events() -> AsyncIterator[dict[str, Any]]:
        async for out in stream.tokens(task):
            yield shapes.native_partial(task, [out], out.text)
        yield shapes.native_final(task, name, [], task.rest(), prompt)

    return EventStream(events(), task, s.p.timeout, done=False)


ROUTES: list[tuple[str, Handler, list[str]]] = [
    ("/health", health, ["GET"]),
    ("/v1/health", health, ["GET"]),
    ("/v1/models", models, ["GET"]),
    ("/models", models, ["GET"]),
    ("/props", props, ["GET"]),
    ("/tokenize", tokenize, ["POST"]),
    ("/detokenize", detokenize, ["POST"]),
    ("/slots", slots, ["GET"]),
    ("/slots/{id_slot}", slot_action, ["POST"]),
    ("/metrics", metrics, ["GET"]),
    ("/v1/chat/completions", chat, ["POST"]),
    ("/chat/completions", chat, ["POST"]),
    ("/v1/completions", completions, ["POST"]),
    ("/completions", completion, ["POST"]),
    ("/completion", completion, ["POST"]),
]
