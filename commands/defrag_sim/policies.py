"""The slot policies on one stream of KVCells: where a ubatch's tokens go, and when to compact.

- non-contiguous: any free cells, from the head, wrapping (KVCells.find_slot, llama.cpp today)
- contiguous: one run of free cells per ubatch, first fit from the head, wrapping (llama.cpp
  before non-contiguous slots); no compaction
- threshold: contiguous; before a decode, compact fully when the holes inside the used span
  exceed `defrag_thold` of it (llama.cpp's old --defrag-thold heuristic)
- on-fail: contiguous; when no run fits, compact fully, then search again (ollama)

Compaction is `kvtool.memory.defrag`'s plan, in passes of at most `max_moves` moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool.commands.defrag_sim.series import Stats, Track
from kvtool.memory.defrag import apply_defrag, plan_defrag
from kvtool.memory.kv_cells import EMPTY, KVCells, seq_bit

BITS = np.array([seq_bit(s) for s in range(64)], dtype=np.uint64)  # sequence id -> its bit
POLICIES = ("non-contiguous", "contiguous", "threshold", "on-fail", "paged")


@dataclass(frozen=True)
class Policy:
    name: str  # one of POLICIES
    defrag_thold: float = 0.1
    max_moves: int = 256
    page_size: int = 16

    @property
    def contiguous(self) -> bool:
        return self.name in ("contiguous", "threshold", "on-fail")


def free_runs(free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends (exclusive) of the runs of True in `free`."""
    edges = np.flatnonzero(free[1:] != free[:-1]) + 1  # where a run starts or ends
    bounds = np.concatenate(([0], edges, [len(free)]))
    first = 0 if len(free) and free[0] else 1  # runs alternate: free ones every other
    return bounds[first:-1:2], bounds[first + 1 :: 2]


def _fill(starts: np.ndarray, ends: np.ndarray, n: int, count: int) -> np.ndarray:
    """Starts of up to `count` slots of n cells packed into the runs, in run order."""
    cap = (ends - starts) // n
    cum = np.cumsum(cap)
    if len(cum) and cum[-1] > count:
        last = int(np.searchsorted(cum, count))
        cap[last] -= cum[last] - count
        cap[last + 1 :] = 0
        cum = np.cumsum(cap)
    k = int(cum[-1]) if len(cum) else 0
    return np.repeat(starts, cap) + n * (np.arange(k) - np.repeat(cum - cap, cap))


def contiguous_slots(free: np.ndarray, head: int, n: int, count: int) -> np.ndarray:
    """Starts of up to `count` successive slots of n free cells, as `count` first-fit searches
    would place them: from the head to the end (a slot never wraps), then from cell 0; each
    search starts where the previous slot ended. Fewer than `count` when the cells run out."""
    starts, ends = free_runs(free)
    after = ends > head
    s1, e1 = np.maximum(starts[after], head), ends[after]
    out = _fill(s1, e1, n, count)
    if len(out) == count or head == 0:  # head 0: the first search went over every cell
        return out
    # wrapped: from cell 0 on what is left before the head (a run holding the head keeps its
    # part before the head, or all of it when nothing fitted after the head)
    s2, e2 = starts[starts < head], np.minimum(ends[starts < head], head)
    if len(e2) and ends[len(e2) - 1] > head and (ends[len(e2) - 1] - head) < n:
        e2[-1] = ends[len(e2) - 1]
    return np.concatenate((out, _fill(s2, e2, n, count - len(out))))


def first_free(free: np.ndarray, head: int, m: int) -> np.ndarray:
    """The first m free cells from the head, wrapping (KVCells.find_slot without a window);
    the caller knows that m cells are free."""
    a = np.flatnonzero(free[head:]) + head
    if len(a) >= m:
        return a[:m]
    return np.concatenate((a, np.flatnonzero(free[:head])[: m - len(a)]))


class CellStream:
    """One stream of cells under a cell policy; counts into `stats`, reports to `track`.
    Cells in use and the used span are kept up to date here (numpy passes over the whole
    stream at every step would dominate the replay)."""

    def __init__(self, size: int, policy: Policy, stats: Stats, track: Track) -> None:
        self.cells = KVCells(size)
        self.size = size
        self.policy = policy
        self.stats = stats
        self.track = track
        self.compacted_at: list[int] = []
        self.used = 0
        self.span = 0  # one past the last used cell

    def _recount(self) -> None:
        u = np.flatnonzero(self.cells.pos != EMPTY)
        self.used, self.span = len(u), int(u[-1]) + 1 if len(u) else 0

    def _report(self, t: int) -> None:
        self.track.set(t, self.used, self.span)

    def owners(self) -> np.ndarray:
        """[size] the lowest sequence id of each cell, -1 when empty (for the cell map)."""
        bits = self.cells.seq
        low = bits & (~bits + np.uint64(1))  # lowest set bit
        out = np.full(self.cells.size, -1, dtype=np.int16)
        used = bits != 0
        out[used] = np.log2(low[used].astype(np.float64)).astype(np.int16)
        return out

    # -- slots ----------------------------------------------------------------------------------
    def slots(self, n: int, count: int) -> np.ndarray:
        """[j, n] cells for up to `count` successive ubatches of n tokens (j < count: no room).
        Non-contiguous: one search for j * n cells, which is where j searches of n would put
        them, except that llama.cpp's head reset is checked once instead of j times."""
        c = self.cells
        free = c.pos == EMPTY
        if not self.policy.contiguous:
            j = min(count, (c.size - self.used) // n)
            head = 0 if c.head > self.used + 2 * j * n else c.head
            return first_free(free, head, j * n).reshape(j, n)
        head = 0 if c.head > self.used + 2 * n else c.head
        return contiguous_slots(free, head, n, count).reshape(-1, 1) + np.arange(n)

    def compact(self, t: int) -> bool:
        plan = plan_defrag(self.cells, self.policy.max_moves)
        if not plan.n_moves:
            return False
        st = self.stats
        st.compactions += 1
        st.passes += plan.n_passes
        st.moves += plan.n_moves
        st.cells_moved += plan.n_cells
        apply_defrag(self.cells, plan)
        self.span = self.used
        self.compacted_at.append(t)
        self._report(t)
        return True

    def before_decode(self, t: int) -> None:
        """The threshold policy's check (llama.cpp ran it in the memory update before a decode)."""
        holes = 1.0 - self.used / self.span if self.span else 0.0
        if self.policy.name == "threshold" and holes > self.policy.defrag_thold:
            self.compact(t)

    # -- placing tokens -------------------------------------------------------------------------
    def place(self, t: int, parts: list[tuple[int, int, int]]) -> list[int]:
        """One ubatch of (seq, first pos, n_tokens); returns the sequences that found no room
        even alone (the caller drops their requests)."""
        m = sum(n for _, _, n in parts)
        got = self.slots(m, 1)
        if not len(got) and self.policy.name == "on-fail" and self.compact(t):
            got = self.slots(m, 1)
        if len(got):
            self._apply(got[0], parts)
            self._report(t)
            return []
        self.stats.failed_allocs += 1
        dropped = []
        if len(parts) > 1 and m == len(parts):  # one token each: the searches for one cell at once
            got = self.slots(1, m)
            if len(got):
                self._apply(got[:, 0], parts[: len(got)])
            dropped = [s for s, _, _ in parts[len(got) :]]
        elif len(parts) > 1:  # retry each sequence's part alone, like a server halving its batch
            for part in parts:
                one = self.slots(part[2], 1)
                if len(one):
                    self._apply(one[0], [part])
                else:
                    dropped.append(part[0])
        else:
            dropped.append(parts[0][0])
        self._report(t)
        return dropped

    def _apply(self, idx: np.ndarray, parts: list[tuple[int, int, int]]) -> None:
        seq, p0, n = (np.array(a, dtype=np.int64) for a in zip(*parts, strict=True))
        pos = np.repeat(p0 - (np.cumsum(n) - n), n) + np.arange(len(idx))
        self.cells.apply(idx, pos, np.repeat(BITS[seq], n))
        self.used += len(idx)
        self.span = max(self.span, int(idx.max()) + 1)

    def run(self, t: int, seqs: list[int], pos: np.ndarray, k: int) -> int:
        """As many of the k one-token-per-sequence steps from t as fit at once; returns the
        number of steps done (the caller places a failing step with `place`)."""
        n = len(seqs)
        got = self.slots(n, k)  # [j, n]
        j = len(got)
        if not j:
            return 0
        p = pos[seqs][None, :] + np.arange(j)[:, None]  # [j, n]
        self.cells.apply(got.ravel(), p.ravel(), np.tile(BITS[seqs], j))
        used = self.used + n * (np.arange(j) + 1)
        nkv = np.maximum(self.span, np.maximum.accumulate(got.max(axis=1)) + 1)
        self.used, self.span = int(used[-1]), int(nkv[-1])
        self.track.steps(t, used, nkv)
        return j

    # -- sequence ops ---------------------------------------------------------------------------
    def free(self, t: int, seq: int) -> None:
        self.cells.seq_rm(seq, 0, np.iinfo(np.int64).max)
        self._recount()
        self._report(t)

    def share(self, t: int, src: int, dst: int) -> None:
        """seq_cp inside one stream: the cells gain the sequence (metadata only)."""
        c = self.cells
        c.seq[c.has_seq(src)] |= BITS[dst]
        self._report(t)
