"""Per-step series (cells in use, n_kv) summed over streams, and what each stream counts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Stats:
    """Counters of one policy's replay, over all streams."""

    failed_allocs: int = 0  # ubatches (or copies) that found no slot, after any compaction
    dropped: int = 0  # requests that found no slot even alone: their cells were freed
    compactions: int = 0
    passes: int = 0
    moves: int = 0
    cells_moved: int = 0


class Series:
    """`used[t]` and `nkv[t]` after step t's decode, summed over streams. Streams add constant
    stretches through difference arrays and runs of steps explicitly, so a stream that sits
    still costs nothing per step."""

    def __init__(self, n_steps: int) -> None:
        self.n_steps = n_steps
        self._d = np.zeros((2, n_steps + 1), dtype=np.int64)  # [used, nkv] differences
        self._e = np.zeros((2, n_steps), dtype=np.int64)  # [used, nkv] explicit values

    def track(self) -> Track:
        return Track(self)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        v = np.cumsum(self._d, axis=1)[:, : self.n_steps] + self._e
        return v[0], v[1]


class Track:
    """One stream's contribution: its current (used, nkv) holds from step `t` on."""

    def __init__(self, series: Series) -> None:
        self.s = series
        self.t = 0
        self.used = 0
        self.nkv = 0

    def hold(self, t: int) -> None:
        """The current values held for steps [self.t, t)."""
        t = min(t, self.s.n_steps)
        if t > self.t:
            d = self.s._d
            d[0, self.t] += self.used
            d[0, t] -= self.used
            d[1, self.t] += self.nkv
            d[1, t] -= self.nkv
            self.t = t

    def set(self, t: int, used: int, nkv: int) -> None:
        """New values from step t on (after a free before t, or after step t's decode)."""
        self.hold(t)
        self.used, self.nkv = used, nkv

    def steps(self, t: int, used: np.ndarray, nkv: np.ndarray) -> None:
        """Values after each of the steps t .. t+len-1."""
        self.hold(t)
        n = min(len(used), self.s.n_steps - t)
        self.s._e[0, t : t + n] += used[:n]
        self.s._e[1, t : t + n] += nkv[:n]
        self.t = t + len(used)
        self.used, self.nkv = int(used[-1]), int(nkv[-1])
