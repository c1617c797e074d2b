"""What `kvtool kv-types` measures: the user's text run teacher-forced with each K/V cache type
pair beside a reference pair, chunk by chunk as llama-perplexity runs it (each chunk from an
empty cache, scored on its second half), and per pair the reference's and its own next-token
distributions compared at every scored position: KL divergence (full vocabulary), top-1
agreement, perplexity. The pairs run in lockstep, one batch of a chunk at a time, so only one
batch's logits per pair are ever held (Gemma 3's 262k-token vocabulary)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

import kvtool


@dataclass(frozen=True)
class Pair:
    """A K type and a V type ("q8_0", "q8_0/q4_0": K then V)."""

    k: str
    v: str

    @classmethod
    def parse(cls, text: str) -> Pair:
        k, _, v = text.strip().partition("/")
        return cls(k, v or k)

    @property
    def name(self) -> str:
        return self.k if self.k == self.v else f"{self.k}/{self.v}"


@dataclass
class Stats:
    """Running sums over the scored positions of one pair."""

    n: int = 0
    nll: float = 0.0  # sum of -log p(next token)
    kl: list[float] = field(default_factory=list)  # KL(reference || pair) per position
    same_top1: int = 0

    def add(self, logp: torch.Tensor, ref_logp: torch.Tensor, nxt: torch.Tensor) -> None:
        """logp, ref_logp [n, n_vocab] log-probabilities of n positions; nxt [n] their next tokens."""
        self.n += len(nxt)
        self.nll -= float(logp.gather(1, nxt[:, None]).double().sum())
        self.kl += (
            (ref_logp.exp() * (ref_logp - logp)).sum(dim=1, dtype=torch.float64).clamp(min=0.0).tolist()
        )
        self.same_top1 += int((logp.argmax(dim=1) == ref_logp.argmax(dim=1)).sum())


@dataclass(frozen=True)
class Row:
    """One pair's line of the report."""

    type_k: str
    type_v: str
    bytes_per_token: int  # K+V of one cell, every attention layer
    kv_bytes: int  # K and V of a context of n_ctx tokens (sliding windows included)
    n_ctx: int
    ppl: float
    kl: float  # mean over scored positions
    kl_p99: float
    top1: float  # share of positions whose most likely token is the reference's
    n_scored: int


@dataclass(frozen=True)
class Setup:
    n_chunk: int  # tokens per chunk (-c)
    n_batch: int  # tokens per decode
    reference: Pair


def chunks(tokens: Sequence[int], n_chunk: int) -> list[list[int]]:
    """Whole chunks of n_chunk tokens (one shorter chunk when the text has fewer); none when
    no position would be scored (fewer than 3 tokens)."""
    if len(tokens) < max(3, n_chunk):
        return [list(tokens)] if len(tokens) >= 3 else []
    return [list(tokens[i : i + n_chunk]) for i in range(0, len(tokens) - n_chunk + 1, n_chunk)]


def measure(
    model: kvtool.Model,
    tokens: Sequence[int],
    pairs: Sequence[Pair],
    setup: Setup,
    step: Callable[[], None] = lambda: None,
) -> dict[Pair, Stats]:
    """Stats of every pair (the reference included) over the text's chunks; `step` is called
    after each batch of every chunk (progress)."""
    everyone = [setup.reference, *(p for p in pairs if p != setup.reference)]
    ctxs = {p: _context(model, p, setup) for p in everyone}
    stats = {p: Stats() for p in everyone}
    for chunk in chunks(tokens, setup.n_chunk):
        first = len(chunk) // 2  # scored: positions first .. n-2, each predicting the next token
        for ctx in ctxs.values():
            ctx.clear()
        for b0 in range(0, len(chunk), setup.n_batch):
            part = chunk[b0 : b0 + setup.n_batch]
            lo, hi = max(first, b0), min(b0 + len(part), len(chunk) - 1)  # scored rows of this batch
            ref_logp = None
            for p, ctx in ctxs.items():
                ctx.decode(kvtool.Batch.from_tokens(part, seq_id=0, pos0=b0, logits="all"))
                if lo >= hi:
                    continue
                logp = torch.log_softmax(ctx.logits()[lo - b0 : hi - b0], dim=-1)
                if ref_logp is None:
                    ref_logp = logp  # the reference runs first
                nxt = torch.tensor(chunk[lo + 1 : hi + 1])
                stats[p].add(logp, ref_logp, nxt)
            step()
    return stats


def _context(model: kvtool.Model, p: Pair, setup: Setup) -> kvtool.Context:
    params = kvtool.ContextParams(
        n_ctx=setup.n_chunk, n_batch=setup.n_batch, n_ubatch=setup.n_batch, type_k=p.k, type_v=p.v
    )
    return kvtool.Context(model, params)


def report(model: kvtool.Model, stats: dict[Pair, Stats], per_token: dict[Pair, int]) -> list[Row]:
    """The report's rows, the reference first; the KV size is a context of the model's training
    length (what llama.cpp allocates by default), computed without allocating it."""
    rows = []
    n_ctx = model.n_ctx_train
    for p, s in stats.items():
        held = kvtool.Context.memory_breakdown_of(
            model, kvtool.ContextParams(n_ctx=n_ctx, type_k=p.k, type_v=p.v)
        )
        kv = sum(b.k + b.v for b in held.kv)  # as llama.cpp's log counts it
        kl = sorted(s.kl)
        p99 = kl[min(len(kl) - 1, math.ceil(0.99 * len(kl)) - 1)] if kl else 0.0
        rows.append(
            Row(
                p.k,
                p.v,
                per_token[p],
                kv,
                n_ctx,
                math.exp(s.nll / s.n) if s.n else math.nan,
                sum(kl) / len(kl) if kl else 0.0,
                p99,
                s.same_top1 / s.n if s.n else math.nan,
                s.n,
            )
        )
    return rows
