"""Token sampling: llama.cpp's default common sampler chain, vectorized over one logits row.

Chain (common/sampling.cpp, default order): penalties -> top_k -> typical_p -> top_p -> min_p
-> temperature -> dist; ``SamplerParams.samplers`` reorders or leaves out stages as llama.cpp's
--samplers does. DRY, top-n-sigma and XTC sit between these stages in llama.cpp but do nothing
at their default parameters; kvtool takes their names in the order and does not implement them.
Each stage (kvtool/sampler_stages.py) follows src/llama-sampling.cpp: top_k <= 0,
typical_p >= 1, top_p >= 1 and min_p <= 0 switch a stage off; temperature <= 0 makes the final
pick the argmax of the surviving candidates (lowest id on ties) instead of a random draw.
As in llama.cpp, every truncating stage keeps at least one candidate (the best), so no setting
leaves nothing to pick (`min_p` 2 keeps the top token).
"""

from __future__ import annotations

import math
import secrets
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvtool.checks import as_int
from kvtool.errors import KvtoolError
from kvtool.sampler_stages import (
    Candidates,
    draw,
    greedy,
    min_p,
    penalize,
    temperature,
    top_k,
    top_p,
    typical,
)

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # "pick a random seed", as in llama.h

# llama.cpp's default --samplers order; dry, top_n_sigma and xtc are no-ops at their defaults
DEFAULT_SAMPLERS = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)
_NO_OPS = frozenset({"dry", "top_n_sigma", "xtc"})
# llama.cpp's spellings of each stage (common_sampler_types_from_names: kebab-case, no dash, aliases)
_SAMPLER_NAMES = {
    **{n: n for n in DEFAULT_SAMPLERS},
    **{n.replace("_", "-"): n for n in DEFAULT_SAMPLERS if "_" in n},
    **{n.replace("_", ""): n for n in DEFAULT_SAMPLERS if "_" in n},
    "nucleus": "top_p",
    "temp": "temperature",
    "typ": "typ_p",
}


def sampler_order(names: Sequence[str]) -> tuple[str, ...]:
    """The stages `names` give (any of llama.cpp's --samplers spellings, case-insensitive; empty
    names are skipped), as canonical names; an unknown name is a KvtoolError."""
    out = []
    for raw in names:
        name = raw.strip().lower()
        if not name:
            continue
        if name not in _SAMPLER_NAMES:
            known = ", ".join(DEFAULT_SAMPLERS)
            raise KvtoolError(f"unknown sampler '{raw.strip()}' (known: {known})")
        out.append(_SAMPLER_NAMES[name])
    return tuple(out)


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
    samplers: tuple[str, ...] = DEFAULT_SAMPLERS

    def check(self) -> None:
        """Raises KvtoolError naming the first parameter that has no meaning (TypeError for
        one of the wrong type)."""
        for name in ("seed", "top_k", "repeat_last_n", "min_keep"):
            as_int(getattr(self, name), f"sampler: {name}")
        for name in ("temp", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"sampler: {name} must be a number, got {type(v).__name__}")
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
        for name in ("top_k", "repeat_last_n", "min_keep"):  # a window or a count: past any vocabulary
            if getattr(self, name) >= 2**31:
                raise KvtoolError(f"sampler: {name} must be below 2**31, got {getattr(self, name)}")
        sampler_order(self.samplers)


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
        self._params = replace(params, samplers=sampler_order(params.samplers))
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
        """Record ``token`` in the penalty window (the last ``repeat_last_n`` accepted tokens).
        A token id that is not an int is a TypeError, a negative one a KvtoolError."""
        token = as_int(token, "an accepted token")
        if token < 0:
            raise KvtoolError(f"sampler: accepted token {token} is not a token id")
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
        is not modified). The math and the draw run on CPU, so a seed reproduces across devices.
        Anything but a 1-D floating-point tensor is refused: a TypeError for another type, a
        KvtoolError for another shape (a batch of rows would be read as one long row)."""
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            what = f"a {logits.dtype} tensor" if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise TypeError(f"sampler: logits must be a floating-point torch tensor, got {what}")
        if logits.dim() != 1:
            raise KvtoolError(f"sampler: logits must be one row [n_vocab], got shape {list(logits.shape)}")
        p = self._params
        row = logits.detach().to("cpu", torch.float32)
        _check_logits(row)
        if self._all_ids.numel() != row.numel():
            self._all_ids = torch.arange(row.numel())
        c = Candidates.from_logits(row, self._all_ids)
        if _greedy_shortcut(p):
            # top-k, top-p and min-p always keep the best token (lowest id on ties): their
            # passes over the whole row cannot change what greedy picks
            return greedy(self._stage(c, "penalties") if "penalties" in p.samplers else c)
        for stage in p.samplers:
            c = self._stage(c, stage)
        if "temperature" in p.samplers and p.temp <= 0.0:
            return greedy(c)
        return draw(c, self._generator)

    def _stage(self, c: Candidates, stage: str) -> Candidates:
        """One stage of the chain on the candidates still in play."""
        p = self._params
        if stage == "penalties":
            if p.repeat_last_n == 0:
                return c
            return penalize(c, self._counts, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)
        if stage == "top_k":
            return top_k(c, p.top_k)
        if stage == "typ_p":
            return typical(c, p.typical_p, p.min_keep)
        if stage == "top_p":
            return top_p(c, p.top_p, p.min_keep)
        if stage == "min_p":
            return min_p(c, p.min_p, p.min_keep)
        if stage == "temperature":
            # llama.cpp's temp_ext: <= 0 keeps only the best token, wherever the stage stands
            if p.temp <= 0.0:
                return c.take(c.ids == greedy(c), sorted=c.sorted)
            return temperature(c, p.temp)
        assert stage in _NO_OPS, stage
        return c


def _greedy_shortcut(p: SamplerParams) -> bool:
    """Whether the chain's pick is the best token of the (penalized) row: greedy, no typical
    stage (it may drop the best token), and the penalties (if any) before every other stage."""
    if p.temp > 0.0 or "temperature" not in p.samplers:
        return False
    if p.typical_p < 1.0 and "typ_p" in p.samplers:
        return False
    active = [s for s in p.samplers if s not in _NO_OPS]
    return "penalties" not in active or active[0] == "penalties"
