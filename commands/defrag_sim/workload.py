"""Workloads for defrag-sim: a timeline of decode steps, compressed into ops.

An op happens at a decode step `t` (steps count decodes only; idle time is skipped):

- `Free(t, seq, p0, p1)`: seq_rm(seq, p0, p1) before step t's decode (by default p0 = p1 = -1:
  every cell of the sequence).
- `Copy(t, src, seq, p0, p1)`: seq_cp(src, seq, p0, p1) before step t's decode.
- `Decode(t, parts)`: step t decodes `parts`, (seq, n_tokens) in batch order.
- `Run(t, seqs, k)`: steps t .. t+k-1 each decode one token of every sequence in `seqs`
  (generation between two request boundaries: one op instead of k).

The synthetic workload is llama-parallel's server seen from the cache: `clients` slots, client
c decodes on sequence c; a request decodes its prompt in one step (with the other clients'
generated tokens), then one generated token per step, and its cells are freed when it ends.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Free:
    t: int
    seq: int
    p0: int = -1  # a range [p0, p1) of positions; negative bounds are open
    p1: int = -1

    @property
    def whole(self) -> bool:
        return self.p0 <= 0 and self.p1 < 0


@dataclass(frozen=True)
class Copy:
    t: int
    src: int
    seq: int
    p0: int = -1
    p1: int = -1

    @property
    def whole(self) -> bool:
        return self.p0 <= 0 and self.p1 < 0


@dataclass(frozen=True)
class Decode:
    t: int
    parts: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Run:
    t: int
    seqs: tuple[int, ...]
    k: int


Op = Free | Copy | Decode | Run


@dataclass(frozen=True)
class Workload:
    """Ops in step order, the number of decode steps, sequences and requests, and a name."""

    ops: tuple[Op, ...]
    n_steps: int
    n_seq: int
    n_requests: int
    name: str


@dataclass(frozen=True)
class LengthDist:
    """A token-count distribution: `fixed`, `uniform` (1 .. 2*mean-1), `exp` or `lognormal`
    (sigma 1), all with the given mean, clipped to [1, cap]."""

    kind: str
    mean: int

    KINDS = ("fixed", "uniform", "exp", "lognormal")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """'300' (fixed) or 'KIND:MEAN', e.g. 'lognormal:300'."""
        kind, _, mean = text.rpartition(":")
        kind = kind or "fixed"
        try:
            m = int(mean)
        except ValueError:
            raise ValueError(f"'{text}': expected KIND:MEAN with an integer mean") from None
        if kind not in cls.KINDS or m < 1:
            raise ValueError(f"'{text}': KIND is one of {', '.join(cls.KINDS)} and MEAN >= 1")
        return cls(kind, m)

    def sample(self, rng: np.random.Generator, n: int, cap: int) -> np.ndarray:
        m = self.mean
        if self.kind == "fixed":
            x = np.full(n, m, dtype=np.float64)
        elif self.kind == "uniform":
            x = rng.integers(1, 2 * m, size=n).astype(np.float64)
        elif self.kind == "exp":
            x = np.ceil(rng.exponential(m, size=n))
        else:
            x = rng.lognormal(np.log(m) - 0.5, 1.0, size=n)  # mean exp(mu + 1/2) = m
        return np.clip(np.rint(x), 1, cap).astype(np.int64)


@dataclass(frozen=True)
class SyntheticParams:
    """A synthetic server workload (see the module docstring)."""

    clients: int = 32
    requests: int = 1000
    arrival: str = "closed"  # closed: a free client takes the next request at once; poisson
    rate: float = 0.5  # poisson: requests per decode step
    prompt: LengthDist = LengthDist("lognormal", 300)
    gen: LengthDist = LengthDist("exp", 200)
    n_ctx: int = 16384
    seed: int = 42


def synthetic(p: SyntheticParams) -> Workload:
    """Draws the requests (seeded) and schedules them on the clients."""
    rng = np.random.default_rng(p.seed)
    prompt = p.prompt.sample(rng, p.requests, p.n_ctx)
    gen = p.gen.sample(rng, p.requests, p.n_ctx)
    if p.arrival == "closed":
        arrive = np.zeros(p.requests, dtype=np.int64)
    else:
        arrive = np.floor(np.cumsum(rng.exponential(1.0 / p.rate, size=p.requests))).astype(np.int64)
    ops = _schedule(p.clients, prompt.tolist(), gen.tolist(), arrive.tolist())
    name = f"synthetic: {p.clients} clients, {p.requests} requests, {p.arrival} arrivals"
    name += f", prompt {p.prompt.kind}:{p.prompt.mean}, gen {p.gen.kind}:{p.gen.mean}, seed {p.seed}"
    n_steps = max((op_end(op) for op in ops), default=0)
    return Workload(tuple(ops), n_steps, p.clients, p.requests, name)


def op_end(op: Op) -> int:
    """The step after the op's last decode (its own step for a free or a copy)."""
    return op.t + op.k if isinstance(op, Run) else op.t + 1 if isinstance(op, Decode) else op.t


def _schedule(n_clients: int, prompt: list[int], gen: list[int], arrive: list[int]) -> list[Op]:
    """Event loop over decode steps; `clock` is arrival time, `t` counts decode steps only."""
    ops: list[Op] = []
    idle = list(range(n_clients))  # a heap: the lowest free client takes the next request
    ends: list[tuple[int, int]] = []  # heap of (step the cells are freed, seq)
    generating: set[int] = set()
    t = skipped = nxt = 0
    n = len(prompt)
    while nxt < n or ends:
        while ends and ends[0][0] == t:
            seq = heapq.heappop(ends)[1]
            ops.append(Free(t, seq))
            generating.discard(seq)
            heapq.heappush(idle, seq)
        if not generating and not ends and nxt < n and arrive[nxt] > t + skipped:
            skipped = arrive[nxt] - t  # nothing to decode until the next arrival
        starters: list[tuple[int, int]] = []
        while idle and nxt < n and arrive[nxt] <= t + skipped:
            seq = heapq.heappop(idle)
            starters.append((seq, prompt[nxt]))
            heapq.heappush(ends, (t + gen[nxt] + 1, seq))  # prompt at t, gen tokens at t+1 .. t+gen
            nxt += 1
        gen_now = tuple(sorted(generating))
        if starters:
            ops.append(Decode(t, tuple((s, 1) for s in gen_now) + tuple(starters)))
            generating.update(s for s, _ in starters)
            t += 1
            continue
        nxt_event = ends[0][0] if ends else t + 1
        if idle and nxt < n:
            nxt_event = min(nxt_event, max(arrive[nxt] - skipped, t + 1))
        if gen_now:
            ops.append(Run(t, gen_now, nxt_event - t))
        t = nxt_event
    return ops
