"""The stages of the sampler chain, each a function of the candidates still in play
(src/llama-sampling.cpp): penalties, top-k, typical, top-p, min-p, temperature, and the final
pick (greedy or a draw)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Candidates:
    """Tokens still in play. Invariant: ``ids`` ascending, or (``sorted``) by logit descending
    with lower ids first on ties, so every tie is broken toward the lower id."""

    ids: torch.Tensor  # int64 [n]
    logits: torch.Tensor  # float32 [n]
    sorted: bool = False

    @classmethod
    def from_logits(cls, logits: torch.Tensor, ids: torch.Tensor | None = None) -> Candidates:
        """All tokens of a float ``[n_vocab]`` row (``ids``: a cached ``arange(n_vocab)``)."""
        return cls(torch.arange(logits.numel()) if ids is None else ids, logits)

    def take(self, index: torch.Tensor | slice, sorted: bool) -> Candidates:
        """The candidates at ``index`` (positions or a bool mask), in that order."""
        return Candidates(self.ids[index], self.logits[index], sorted)

    def sort(self) -> Candidates:
        """The same candidates by logit descending (lower id first on ties)."""
        if self.sorted:
            return self
        # Stable descending sort keeps the ascending-id order among equal logits.
        order = torch.sort(self.logits, descending=True, stable=True).indices
        return self.take(order, sorted=True)


def apply_penalties(
    logits: torch.Tensor, counts: dict[int, int], repeat: float, frequency: float, presence: float
) -> torch.Tensor:
    """Penalize the tokens in ``counts`` (token -> occurrences in the window); returns a new row.

    Repeat divides positive logits and multiplies the others (so it always lowers them);
    frequency subtracts ``count * frequency``, presence subtracts ``presence`` once.
    """
    n_vocab = logits.numel()
    seen = [(t, c) for t, c in counts.items() if 0 <= t < n_vocab]
    if not seen or (repeat == 1.0 and frequency == 0.0 and presence == 0.0):
        return logits
    tokens = torch.tensor([t for t, _ in seen], dtype=torch.int64)
    count = torch.tensor([c for _, c in seen], dtype=logits.dtype)
    old = logits[tokens]
    new = torch.where(old <= 0, old * repeat, old / repeat) - (count * frequency + presence)
    return logits.index_put((tokens,), new)


def penalize(
    c: Candidates, counts: dict[int, int], repeat: float, frequency: float, presence: float
) -> Candidates:
    """`apply_penalties` on the candidates still in play (a stage after a truncating one); the
    result is back in id order, since the penalties may change the logits' order."""
    if c.sorted:
        c = c.take(torch.argsort(c.ids), sorted=False)
    if c.ids.numel() == 0 or int(c.ids[-1]) + 1 == c.ids.numel():  # the whole row
        return Candidates(c.ids, apply_penalties(c.logits, counts, repeat, frequency, presence))
    full = torch.zeros(int(c.ids[-1]) + 1, dtype=c.logits.dtype)
    full[c.ids] = c.logits
    return Candidates(c.ids, apply_penalties(full, counts, repeat, frequency, presence)[c.ids])


def top_k(c: Candidates, k: int) -> Candidates:
    """Keep the ``k`` highest logits (``k <= 0``: off). Result is sorted."""
    if k <= 0:
        return c
    if k >= c.logits.numel() or c.sorted:
        return c.sort().take(slice(0, k), sorted=True)
    # topk on the whole row, then sort only the k survivors (in id order, for the tie rule).
    values, pos = torch.topk(c.logits, k, sorted=False)
    at_least_kth = c.logits >= values.min()
    # Ties straddling the cut: keep every tied token and let the stable sort settle them by id.
    straddle = int(at_least_kth.sum()) > k
    pos = torch.nonzero(at_least_kth).squeeze(1) if straddle else torch.sort(pos).values
    return c.take(pos, sorted=False).sort().take(slice(0, k), sorted=True)


def _first_index(hit: torch.Tensor, n: int) -> int:
    """Count to keep: one past the first True in ``hit``, or ``n`` if there is none."""
    where = torch.nonzero(hit)
    return int(where[0, 0]) + 1 if where.numel() else n


def typical(c: Candidates, p: float, min_keep: int = 0) -> Candidates:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy,
    until their probability mass exceeds ``p`` (``p >= 1``: off)."""
    if p >= 1.0:
        return c
    c = c.sort()
    probs = torch.softmax(c.logits.double(), dim=0)
    entropy = torch.special.entr(probs).sum()
    order = torch.argsort((-torch.log(probs) - entropy).abs(), stable=True)
    cum = torch.cumsum(probs[order], dim=0)
    rank = torch.arange(cum.numel())
    n_keep = _first_index((cum > p) & (rank >= min_keep - 1), cum.numel())
    # Restoring positional order keeps the kept subset sorted by logit.
    return c.take(torch.sort(order[:n_keep]).values, sorted=True)


def _nucleus_hits(c: Candidates, log_total: torch.Tensor, p: float, min_keep: int) -> torch.Tensor:
    """Per sorted position: has the prefix up to it reached mass ``p`` and ``min_keep`` tokens?"""
    cum = torch.cumsum(torch.exp(c.logits.double() - log_total), dim=0)
    return (cum >= p) & (torch.arange(1, cum.numel() + 1) >= min_keep)


def top_p(c: Candidates, p: float, min_keep: int = 0) -> Candidates:
    """Nucleus: keep the smallest prefix (by probability) whose mass reaches ``p`` (``p >= 1``: off)."""
    if p >= 1.0:
        return c
    n = c.logits.numel()
    log_total = torch.logsumexp(c.logits.double(), dim=0)
    # As llama.cpp does, first try a sorted head of 256: it nearly always holds the nucleus, and
    # sorting a 262144-token vocabulary costs far more than everything else here.
    head = c.sort() if c.sorted or n <= 1024 else top_k(c, 256)
    hit = _nucleus_hits(head, log_total, p, min_keep)
    if not bool(hit.any()) and head.logits.numel() < n:
        head = c.sort()
        hit = _nucleus_hits(head, log_total, p, min_keep)
    return head.take(slice(0, _first_index(hit, n)), sorted=True)


def min_p(c: Candidates, p: float, min_keep: int = 0) -> Candidates:
    """Keep tokens with probability >= ``p`` times the top probability (``p <= 0``: off)."""
    if p <= 0.0 or c.logits.numel() == 0:
        return c
    # p_i >= p * p_max  <=>  logit_i >= max_logit + log(p): no softmax needed.
    keep = c.logits >= c.logits.max() + math.log(p)
    min_keep = max(1, min_keep)  # llama.cpp: the best token survives any p (even p > 1)
    if int(keep.sum()) >= min_keep:
        return c.take(keep, sorted=c.sorted)
    return c.sort().take(slice(0, min_keep), sorted=True)


def temperature(c: Candidates, temp: float) -> Candidates:
    """Divide logits by ``temp`` (> 0; ``temp <= 0`` is handled as greedy by the sampler)."""
    return Candidates(c.ids, c.logits / temp, c.sorted)


def greedy(c: Candidates) -> int:
    """The candidate with the highest logit, the lowest id on ties."""
    return int(c.ids[c.logits == c.logits.max()].min())


def draw(c: Candidates, generator: torch.Generator) -> int:
    """One draw from softmax(logits): a single uniform number against the cumulative mass."""
    cum = torch.cumsum(torch.softmax(c.logits.double(), dim=0), dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    # First index whose running mass exceeds u * total: zero-probability tokens are never chosen.
    i = int(torch.searchsorted(cum, u * cum[-1], right=True))
    return int(c.ids[min(i, cum.numel() - 1)])
