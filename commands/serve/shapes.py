"""The JSON of llama-server's answers (server-task.cpp): OpenAI's chat and text completions,
streamed as chunks or whole, and llama.cpp's native /completion, each with `timings` and
usage.prompt_tokens_details.cached_tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvtool.common.task import Task, TokenOut, TokenProb

FINISH = {"eos": "stop", "word": "stop"}  # anything else ends by length


@dataclass(frozen=True)
class Head:
    """What every chunk of one answer repeats."""

    id: str
    model: str
    created: int

    @classmethod
    def new(cls, prefix: str, model: str, task_id: int) -> Head:
        return cls(f"{prefix}-{task_id:x}{int(time.time() * 1e6):x}", model, int(time.time()))


def usage(task: Task) -> dict[str, Any]:
    return {
        "completion_tokens": task.n_decoded,
        "prompt_tokens": task.n_prompt,
        "total_tokens": task.n_decoded + task.n_prompt,
        "prompt_tokens_details": {"cached_tokens": task.timings.cache_n},
    }


def _prob(p: TokenProb) -> dict[str, Any]:
    return {
        "id": p.id,
        "token": p.piece.decode("utf-8", errors="replace"),
        "bytes": list(p.piece),
        "logprob": p.logprob,
    }


def logprobs(outs: list[TokenOut]) -> dict[str, Any] | None:
    content = [{**_prob(o.prob), "top_logprobs": [_prob(t) for t in o.top]} for o in outs if o.prob]
    return {"content": content} if content else None


def finish_reason(task: Task) -> str:
    return FINISH.get(task.stop, "length")


def chat(h: Head, task: Task, outs: list[TokenOut]) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "finish_reason": finish_reason(task),
        "index": 0,
        "message": {"role": "assistant", "content": task.text},
    }
    if lp := logprobs(outs):
        choice["logprobs"] = lp
    return {
        "choices": [choice],
        "created": h.created,
        "model": h.model,
        "object": "chat.completion",
        "usage": usage(task),
        "id": h.id,
        "timings": task.timings.to_dict(),
    }


def chat_chunk(h: Head, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"finish_reason": finish, "index": 0, "delta": delta}
    if lp:
        choice["logprobs"] = lp
    return {
        "choices": [choice],
        "created": h.created,
        "id": h.id,
        "model": h.model,
        "object": "chat.completion.chunk",
    }


def chat_tail(h: Head, task: Task, include_usage: bool) -> list[dict[str, Any]]:
    """The closing chunks: the finish reason, then (with include_usage) the usage; timings on the last."""
    out = [chat_chunk(h, {}, finish_reason(task))]
    if include_usage:
        out.append({**chat_chunk(h, {}), "choices": [], "usage": usage(task)})
    out[-1]["timings"] = task.timings.to_dict()
    return out


def text_completion(h: Head, task: Task, text: str, outs: list[TokenOut], final: bool) -> dict[str, Any]:
    res: dict[str, Any] = {
        "choices": [
            {
                "text": text,
                "index": 0,
                "logprobs": logprobs(outs),
                "finish_reason": finish_reason(task) if final else None,
            }
        ],
        "created": h.created,
        "model": h.model,
        "object": "text_completion",
        "id": h.id,
    }
    if final:
        res["usage"] = usage(task)
        res["timings"] = task.timings.to_dict()
    return res


def native_partial(task: Task, outs: list[TokenOut], text: str) -> dict[str, Any]:
    res: dict[str, Any] = {
        "index": 0,
        "content": text,
        "tokens": [o.id for o in outs],
        "stop": False,
        "id_slot": task.slot,
        "tokens_predicted": task.n_decoded,
        "tokens_evaluated": task.n_prompt,
    }
    if lp := logprobs(outs):
        res["completion_probabilities"] = lp["content"]
    return res


def native_final(task: Task, model: str, outs: list[TokenOut], text: str, prompt: str) -> dict[str, Any]:
    stop_type = {"eos": "eos", "word": "word", "limit": "limit"}.get(task.stop, "none")
    res: dict[str, Any] = {
        "index": 0,
        "content": text,
        "tokens": [o.id for o in outs],
        "id_slot": task.slot,
        "stop": True,
        "model": model,
        "tokens_predicted": task.n_decoded,
        "tokens_evaluated": task.n_prompt,
        "generation_settings": settings(task),
        "prompt": prompt,
        "has_new_line": "\n" in task.text,
        "truncated": task.truncated,
        "stop_type": stop_type,
        "stopping_word": task.stopping_word,
        "tokens_cached": task.n_prompt + task.n_decoded,
        "timings": task.timings.to_dict(),
    }
    if lp := logprobs(outs):
        res["completion_probabilities"] = lp["content"]
    return res


def settings(task: Task) -> dict[str, Any]:
    """The request's generation settings, llama-server's names."""
    req, sp = task.req, task.req.sampler
    return {
        "n_predict": req.n_predict,
        "seed": task.sampler.seed,
        "temperature": sp.temp,
        "top_k": sp.top_k,
        "top_p": sp.top_p,
        "min_p": sp.min_p,
        "typical_p": sp.typical_p,
        "repeat_last_n": sp.repeat_last_n,
        "repeat_penalty": sp.repeat_penalty,
        "presence_penalty": sp.presence_penalty,
        "frequency_penalty": sp.frequency_penalty,
        "stop": list(req.stop),
        "ignore_eos": req.ignore_eos,
        "n_probs": req.n_probs,
        "cache_prompt": req.cache_prompt,
        "id_slot": req.id_slot,
    }
