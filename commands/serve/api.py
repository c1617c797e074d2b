"""Request bodies to scheduler requests, as llama-server reads them: each known field checked
for its type and range (a wrong one is an OpenAI-shaped HTTP 400), unknown fields ignored. A
field of llama-server's that asks for what kvtool lacks (a grammar, tools, another sampler) is
a 400 unless its value asks for nothing: an answer without it would look like one with it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import kvtool
from kvtool.common.task import Request


class ApiError(Exception):
    """An OpenAI-shaped error answer: {"error": {"code", "message", "type"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": str(self), "type": self.kind}}


def bad(message: str) -> ApiError:
    return ApiError(400, message)


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request's JSON object; what is not JSON text (half a surrogate pair, nesting past
    Python's recursion limit) is a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # Python's parser recurses per level; no request needs this many
        raise bad("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:  # as llama-server's parser: a \u escape of half a surrogate pair is not JSON text
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise bad("the request body is nested too deeply") from None
    except UnicodeEncodeError:
        raise bad("the request body is not valid JSON: a \\u escape names half of a surrogate pair") from None
    return body


def _value(
    body: dict[str, Any], key: str, default: Any, kinds: tuple[type, ...], what: str, lo: Any, hi: Any
) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, kinds):
        raise bad(f"'{key}' must be {what}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        span = f"at most {hi}" if lo is None else f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(f"'{key}' must be {span}, got {v}")
    return v


def _number(
    body: dict[str, Any], key: str, default: float, lo: float | None = None, hi: float | None = None
) -> float:
    return float(_value(body, key, default, (int, float), "a number", lo, hi))


def integer(
    body: dict[str, Any], key: str, default: int, lo: int | None = None, hi: int | None = None
) -> int:
    return int(_value(body, key, default, (int,), "an integer", lo, hi))


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false")
    return v


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise bad("'stop' must be a string or a list of strings")


def _off(v: Any) -> bool:
    """A sampler strength at its inert value: 0, or a negative one as llama.cpp reads it."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0


# llama-server's fields that kvtool does not implement, each with a test of the values that ask
# for nothing (as llama.cpp reads them), and what the field would need
_LACKING: tuple[tuple[str, Any, str], ...] = (
    ("response_format", lambda v: isinstance(v, dict) and v.get("type") in (None, "", "text"), "grammars"),
    ("json_schema", lambda v: False, "grammars"),
    ("grammar", lambda v: v == "", "grammars"),
    ("tools", lambda v: v == [], "tool calls"),
    ("tool_choice", lambda v: v in ("none", "auto"), "tool calls"),
    ("logit_bias", lambda v: v in ({}, []), "logit biases"),
    ("mirostat", lambda v: v == 0 and not isinstance(v, bool), "the mirostat sampler"),
    ("dry_multiplier", _off, "the DRY sampler"),
    ("xtc_probability", _off, "the XTC sampler"),
    ("top_n_sigma", _off, "the top-n-sigma sampler"),
)


def _lacking(body: dict[str, Any]) -> None:
    """A 400 for a field that asks for what kvtool serve does not do."""
    for key, inert, what in _LACKING:
        v = body.get(key)
        if v is not None and not inert(v):
            raise bad(f"'{key}' is not supported: kvtool serve has no {what} (leave it out)")


def openai_completion(body: dict[str, Any]) -> None:
    """OpenAI's text-completion fields that llama-server refuses, refused in its words: `echo`
    true, `best_of` and `suffix` (they were ignored: the answer looked like one that honoured
    them); their inert values (null, `best_of` 1, `suffix` "") pass, which llama-server refuses."""
    if flag(body, "echo", False):
        raise bad("Only no echo is supported")
    for key, inert in (("best_of", 1), ("suffix", "")):
        if body.get(key) not in (None, inert):
            raise bad(f"Unsupported param: {key}")


@dataclass(frozen=True)
class Limits:
    """What the server allows a request: a slot's context, and whether prompts are cached by default."""

    n_ctx_slot: int
    cache_prompt: bool
    n_slots: int


def generation(body: dict[str, Any], tokens: list[int], limits: Limits, chat: bool) -> Request:
    """The sampling and stopping fields common to every completion endpoint."""
    if integer(body, "n", 1) != 1:
        raise bad("only one choice per request is supported ('n' must be 1)")
    _lacking(body)
    n_predict = integer(body, "n_predict", -1, lo=-1)
    n_predict = integer(body, "max_completion_tokens", n_predict, lo=-1)
    n_predict = integer(body, "max_tokens", n_predict, lo=-1)
    if len(tokens) >= limits.n_ctx_slot:
        raise ApiError(
            400,
            f"the request exceeds the available context size: {len(tokens)} prompt tokens, "
            f"{limits.n_ctx_slot} per slot",
            "exceed_context_size_error",
        )
    if not tokens:
        raise bad("the prompt is empty")
    seed = integer(body, "seed", -1)
    sp = kvtool.SamplerParams(
        seed=seed if seed >= 0 else -1,
        temp=_number(body, "temperature", 0.8, 0.0),
        top_k=integer(body, "top_k", 40, 0),
        top_p=_number(body, "top_p", 0.95, 0.0, 1.0),
        min_p=_number(body, "min_p", 0.05, 0.0, 1.0),
        typical_p=_number(body, "typical_p", 1.0, 0.0, 1.0),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0),
        repeat_last_n=integer(body, "repeat_last_n", 64, -1),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
    )
    if sp.repeat_penalty <= 0:
        raise bad("'repeat_penalty' must be positive")
    n_probs = integer(body, "n_probs", 0, 0, 100)
    if chat and flag(body, "logprobs", False):
        n_probs = max(1, integer(body, "top_logprobs", 0, 0, 20))
    elif not chat and body.get("logprobs") is not None:
        n_probs = integer(body, "logprobs", 0, 0, 20)
    return Request(
        tokens,
        n_predict=n_predict,
        sampler=sp,
        stop=_stops(body),
        cache_prompt=flag(body, "cache_prompt", limits.cache_prompt),
        id_slot=integer(body, "id_slot", -1, -1, limits.n_slots - 1),
        n_probs=n_probs,
        ignore_eos=flag(body, "ignore_eos", False),
    )


def messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages, each content a string (text parts are joined)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role' string")
        if m.get("tool_calls") not in (None, []):  # the template would render the turn without them
            raise bad(f"messages[{i}]: 'tool_calls' is not supported: kvtool serve has no tool calls")
        if "content" not in m:  # llama-server's "Expected 'content' or 'tool_calls'"
            raise bad(f"messages[{i}] has no 'content'")
        content = m.get("content")
        if content is None:  # null content is OpenAI's for an assistant turn of tool calls
            content = ""
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad(f"messages[{i}]: only text content parts are supported")
                parts.append(p["text"])
            content = "\n".join(parts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


def prompt_tokens(model: kvtool.Model, body: dict[str, Any], key: str = "prompt") -> list[int]:
    """A completion prompt: a string (tokenized with BOS, specials parsed) or token ids."""
    p = body.get(key)
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # OpenAI's batch form with one prompt
    if isinstance(p, str):
        return model.tokenize(p, add_special=True, parse_special=True)
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad_ids = [t for t in p if not 0 <= t < model.n_vocab]
        if bad_ids:
            raise bad(f"token id {bad_ids[0]} is out of the vocabulary (n_vocab = {model.n_vocab})")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(q, str | list) for q in p):
        raise bad(f"only one prompt per request is supported ('{key}' holds {len(p)})")
    raise bad(f"'{key}' must be a string or a list of token ids")
