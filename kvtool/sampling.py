"""Token sampling: llama.cpp's default common sampler chain, vectorized over one logits row.

Chain (common/sampling.cpp, default order): penalties -> top_k -> typical_p -> top_p -> min_p
-> temperature -> dist. DRY, top-n-sigma and XTC sit between these stages in llama.cpp but are
off by default and not implemented here. Each stage follows src/llama-sampling.cpp: top_k <= 0,
typical_p >= 1, top_p >= 1 and min_p <= 0 switch a stage off; temperature <= 0 makes the final
pick the argmax of the surviving candidates (lowest id on ties) instead of a random draw.
As in llama.cpp, every truncating stage keeps at least one candidate (the best), so no setting
leaves nothing to pick (`min_p` 2 keeps the top token).
"""

from __future__ import annotations

import math
import secrets
from collections import Counter, deque
from dataclasses import dataclass, replace

import torch

from kvtool.errors import KvtoolError

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # "pick a random seed", as in llama.h


@dataclass
class SamplerParams:
    """Sampling parameters, named and defaulted like llama.cpp's common_params_sampling.

    ``seed`` -1 (or 0xFFFFFFFF) asks for a random seed; other values are taken modulo 2**32.
    ``repeat_last_n`` 0 switches penalties off; a negative value covers every accepted token.
    ``min_keep``: truncating stages keep at least this many tokens (each keeps at least one).
    ``Sampler`` refuses (KvtoolError) what has no meaning in llama.cpp either: a NaN or infinite
    value, ``repeat_penalty <= 0``, ``repeat_last_n < -1``, ``min_keep < 0``.
    """

    seed: int = -1
    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_keep: int = 0

    def check(self) -> None:
        """Raises KvtoolError naming the first parameter that has no meaning."""
        for name in ("temp", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise KvtoolError(f"sampler: {name} must be a finite number, got {getattr(self, name)}")
        if not math.isfinite(self.presence_penalty):
            raise KvtoolError(
                f"sampler: presence_penalty must be a finite number, got {self.presence_penalty}"
            )
        if self.repeat_penalty <= 0:
            raise KvtoolError(f"sampler: repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise KvtoolError(f"sampler: repeat_last_n must be >= -1, got {self.repeat_last_n}")
        if self.min_keep < 0:
            raise KvtoolError(f"sampler: min_keep must be >= 0, got {self.min_keep}")


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


def _check_logits(row: torch.Tensor) -> None:
    """Logits a draw can use: no NaN, no +inf, and some token not banned (-inf). A model that
    computes such logits (overflowing f16 weights, a broken GGUF) gives one line, not a crash."""
    if row.numel() == 0:
        raise KvtoolError("sampler: the logits row is empty")
    top = float(row.max())  # torch's max is NaN when any value is
    if math.isnan(top):
        raise KvtoolError("the model computed NaN logits (its weights or the context are broken)")
    if top == math.inf:
        raise KvtoolError("the model computed infinite logits (its weights or the context are broken)")
    if top == -math.inf:
        raise KvtoolError("sampler: every token is banned (all logits are -inf)")


class Sampler:
    """A sampler chain with its penalty history and random state.

    ``sample`` picks a token from one logits row and does not record it; call ``accept`` for
    every token that enters the sequence (llama.cpp's tools accept the prompt tokens too, so
    they count toward the penalties).
    """

    def __init__(self, params: SamplerParams) -> None:
        params.check()
        self._params = replace(params)
        seed = params.seed & 0xFFFFFFFF
        # A random seed is drawn below LLAMA_DEFAULT_SEED so that passing it back reproduces the run.
        self._seed = secrets.randbelow(LLAMA_DEFAULT_SEED) if seed == LLAMA_DEFAULT_SEED else seed
        window = params.repeat_last_n
        self._history: deque[int] = deque(maxlen=window if window > 0 else None)
        self._counts: Counter[int] = Counter()
        self._generator = torch.Generator(device="cpu")
        self._all_ids = torch.arange(0)
        self.reset()

    @property
    def seed(self) -> int:
        """The seed actually used (the random one when the params asked for -1)."""
        return self._seed

    @property
    def params(self) -> SamplerParams:
        """A copy of the parameters."""
        return replace(self._params)

    def reset(self) -> None:
        """Forget accepted tokens and restart the random stream from ``seed``."""
        self._history.clear()
        self._counts.clear()
        self._generator.manual_seed(self._seed)

    def get_state(self) -> tuple[int, list[int], torch.Tensor]:
        """(seed, accepted tokens in the penalty window, random generator state) for saving."""
        return self._seed, list(self._history), self._generator.get_state()

    def set_state(self, seed: int, history: list[int], rng: torch.Tensor) -> None:
        """Continue exactly where a sampler with this state stopped (parameters stay as they are)."""
        self._seed = seed
        self._generator.set_state(rng)
        self._history.clear()
        self._counts.clear()
        for t in history:
            self.accept(t)

    def accept(self, token: int) -> None:
        """Record ``token`` in the penalty window (the last ``repeat_last_n`` accepted tokens)."""
        if self._params.repeat_last_n == 0:
            return
        if self._history.maxlen is not None and len(self._history) == self._history.maxlen:
            old = self._history[0]
            self._counts[old] -= 1
            if self._counts[old] == 0:
                del self._counts[old]
        self._history.append(token)
        self._counts[token] += 1

    def sample(self, logits: torch.Tensor) -> int:
        """Pick a token id from a float ``[n_vocab]`` logits row (any device; the caller's row
        is not modified). The math and the draw run on CPU, so a seed reproduces across devices."""
        p = self._params
        row = logits.detach().reshape(-1).to("cpu", torch.float32)
        _check_logits(row)
        if p.repeat_last_n != 0:
            row = apply_penalties(
                row, self._counts, p.repeat_penalty, p.frequency_penalty, p.presence_penalty
            )
        if self._all_ids.numel() != row.numel():
            self._all_ids = torch.arange(row.numel())
        c = Candidates.from_logits(row, self._all_ids)
        if p.temp <= 0.0 and p.typical_p >= 1.0:
            # top-k, top-p and min-p always keep the best token (lowest id on ties): their
            # passes over the whole row cannot change what greedy picks
            return greedy(c)
        c = top_k(c, p.top_k)
        c = typical(c, p.typical_p, p.min_keep)
        c = top_p(c, p.top_p, p.min_keep)
        c = min_p(c, p.min_p, p.min_keep)
        if p.temp <= 0.0:
            return greedy(c)
        return draw(temperature(c, p.temp), self._generator)
