"""One request to the scheduler and what it becomes: llama-server's task and its result, on
the public API only. A `Request` says what to generate; the `Task` the scheduler makes of it
holds its progress, its text (stop strings held back while they may still match), its
timings (llama-server's `timings`), and tells its owner through `TaskEvents`."""

from __future__ import annotations

import codecs
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import kvtool

if TYPE_CHECKING:
    import torch


@dataclass
class Request:
    """What a client asks for: the prompt's tokens and how to continue them."""

    tokens: list[int]
    n_predict: int = -1  # answer tokens at most (-1: until end of generation or a full slot)
    sampler: kvtool.SamplerParams = field(default_factory=lambda: kvtool.SamplerParams())
    stop: Sequence[str] = ()  # stop strings: the text ends before the first one found
    cache_prompt: bool = True  # reuse what the slot holds, and keep this request's tokens after it
    id_slot: int = -1  # run in this slot (-1: the scheduler chooses)
    min_tokens: int = 0  # no stop is honoured before this many answer tokens (llama-parallel: 3)
    n_probs: int = 0  # the most likely tokens to report beside each answer token (logprobs)
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenProb:
    """A token and its log-probability under the model's raw distribution."""

    id: int
    piece: bytes
    logprob: float


@dataclass(frozen=True)
class TokenOut:
    """One answer token: its id, the text it releases (stop strings are held back until they
    cannot match), and with `n_probs` its log-probability and the most likely alternatives."""

    id: int
    text: str
    prob: TokenProb | None = None
    top: tuple[TokenProb, ...] = ()


@dataclass
class Timings:
    """llama-server's `timings` of one request (milliseconds; cache_n: prompt tokens reused),
    and where those came from (cache_source: "slot", "checkpoint" or a PrefixSource's name) or
    why a longer prefix some slot held was re-processed (cache_reprocessed: a reason of
    kvtool.common.stats.REPROCESS_REASONS)."""

    cache_n: int = 0
    cache_source: str = ""
    cache_reprocessed: str = ""
    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0

    def to_dict(self) -> dict[str, float | int | str]:
        def per(n: int, ms: float) -> tuple[float, float]:
            return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)

        pp, ps = per(self.prompt_n, self.prompt_ms)
        gp, gs = per(self.predicted_n, self.predicted_ms)
        return {
            "cache_n": self.cache_n,
            "cache_source": self.cache_source,
            "cache_reprocessed": self.cache_reprocessed,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": pp,
            "prompt_per_second": ps,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": gp,
            "predicted_per_second": gs,
        }


class TaskEvents(Protocol):
    """What a task's owner hears, on the scheduler's thread: keep it short."""

    def on_start(self, task: Task) -> None: ...
    def on_token(self, task: Task, out: TokenOut) -> None: ...
    def on_done(self, task: Task) -> None: ...


class Task:
    """A request being served. `stop` is "" while it runs, then "eos" (end of generation),
    "word" (a stop string), "limit" (n_predict or the slot's context), "cancelled" or "error"
    (with `error`), as llama-server's stop types."""

    def __init__(self, req: Request, events: TaskEvents | None, tag: object = None) -> None:
        self.req = req
        self.events = events
        self.tag = tag  # the owner's own reference (a client, a connection)
        self.slot = -1
        self.sampler = kvtool.Sampler(req.sampler)
        self.generated: list[int] = []
        self.text = ""  # the answer so far, stop string removed
        self.stop = ""
        self.truncated = False  # the answer stopped because the slot was full (llama-server's name)
        self.stopping_word = ""
        self.error = ""
        self.timings = Timings()
        self.t_queued = time.perf_counter()
        self.t_start = 0.0  # the slot took it
        self.t_first = 0.0  # the first answer token was sampled
        self.t_end = 0.0
        self._sent = 0  # characters of `text` released
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._cancel = threading.Event()
        self.done = threading.Event()

    @property
    def reused_from(self) -> str:
        """Where the reused prefix came from ("" when nothing was reused)."""
        return self.timings.cache_source

    @property
    def n_prompt(self) -> int:
        return len(self.req.tokens)

    @property
    def n_decoded(self) -> int:
        return len(self.generated)

    def cancel(self) -> None:
        """Asks the scheduler to end the task at its next step (any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # -- on the scheduler's thread ---------------------------------------------------------------
    def push(self, model: kvtool.Model, tok: int, logits: torch.Tensor, at_limit: bool = False) -> TokenOut:
        """Records an answer token; returns what it releases. Sets `stop` when the answer ends
        (`at_limit`: the slot has no room for another token)."""
        req = self.req
        self.generated.append(tok)
        may_stop = self.n_decoded >= req.min_tokens
        eog = model.is_eog(tok)
        if not eog:
            self.text += self._decoder.decode(model.token_to_piece(tok, special=False))
        if eog and may_stop:
            self.stop = "eos"
        elif may_stop and self._find_stop():
            self.stop = "word"
        elif at_limit or 0 <= req.n_predict <= self.n_decoded:
            self.stop = "limit"
            self.truncated = not 0 <= req.n_predict <= self.n_decoded
        if self.stop and self.stop != "word":
            self.text += self._decoder.decode(b"", final=True)
        end = len(self.text) if self.stop else len(self.text) - self._held_back()
        out = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        prob, top = _probs(model, logits, tok, req.n_probs) if req.n_probs > 0 else (None, ())
        return TokenOut(tok, out, prob, top)

    def rest(self) -> str:
        """The text still held back once the task has ended (nothing matched)."""
        out = self.text[self._sent :]
        self._sent = len(self.text)
        return out

    def _find_stop(self) -> bool:
        longest = max((len(s) for s in self.req.stop), default=0)
        start = max(0, self._sent - longest)
        hits = [(i, s) for s in self.req.stop if s and (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[:i]
        self.stopping_word = s
        return True

    def _held_back(self) -> int:
        """Characters at the end of the text that begin some stop string."""
        best = 0
        for s in self.req.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best


def _probs(
    model: kvtool.Model, logits: torch.Tensor, tok: int, n: int
) -> tuple[TokenProb, tuple[TokenProb, ...]]:
    """The token's log-probability and the n most likely tokens, from the raw logits (llama-server
    without post_sampling_probs)."""
    import torch

    logp = torch.log_softmax(logits.detach().float().reshape(-1), dim=0)
    vals, ids = torch.topk(logp, min(n, logp.numel()))

    def prob(t: int, lp: float) -> TokenProb:
        return TokenProb(t, model.token_to_piece(t, special=True), lp if math.isfinite(lp) else -1e30)

    top = tuple(prob(int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist(), strict=True))
    return prob(tok, float(logp[tok])), top
