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
from kvtool.commands.defrag_sim.slots import contiguous_slots_near, first_free_near
from kvtool.common.cells import KVCells, apply_defrag, plan_defrag

EMPTY = KVCells.EMPTY
INF = 2**31 - 1  # an open upper bound of a position range
BITS = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))  # sequence id -> its bit


@dataclass(frozen=True)
class Policy:
    name: str  # one of POLICIES
    defrag_thold: float = 0.1
    max_moves: int = 256
    page_size: int = 16

    @property
    def contiguous(self) -> bool:
        return self.name in ("contiguous", "threshold", "on-fail")


class CellStream:
    """One stream of cells under a cell policy; counts into `stats`, reports to `track`.

    The cells are a KVCells; beside it this keeps what a replay asks for at every op, so no op
    passes over the whole stream: the free mask, cells in use, the used span, and each
    sequence's cells (a whole-sequence seq_rm then touches only those)."""

    def __init__(self, size: int, policy: Policy, stats: Stats, track: Track) -> None:
        self.cells = KVCells(size)
        self.size = size
        self.policy = policy
        self.stats = stats
        self.track = track
        self.compacted_at: list[int] = []
        self.first_compaction: KVCells | None = None  # the cells just before it (--replay)
        self.free_mask = np.ones(size, dtype=bool)
        self.where: dict[int, list[np.ndarray]] = {}  # seq -> the cells it was placed in
        self.used = 0
        self.span = 0  # one past the last used cell

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
        if not self.policy.contiguous:
            j = min(count, (c.size - self.used) // n)
            head = 0 if c.head > self.used + 2 * j * n else c.head
            return first_free_near(self.free_mask, head, j * n).reshape(j, n)
        head = 0 if c.head > self.used + 2 * n else c.head
        return contiguous_slots_near(self.free_mask, head, n, count).reshape(-1, 1) + np.arange(n)

    def compact(self, t: int) -> bool:
        plan = plan_defrag(self.cells, self.policy.max_moves)
        if not plan.n_moves:
            return False
        st = self.stats
        st.compactions += 1
        st.passes += plan.n_passes
        st.moves += plan.n_moves
        st.cells_moved += plan.n_cells
        if self.first_compaction is None:
            self.first_compaction = self.cells.copy()
        apply_defrag(self.cells, plan)
        dest = np.arange(self.size)  # where each cell's content went
        for moves in plan.passes:
            lens = moves[:, 2]
            off = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
            dest[np.repeat(moves[:, 0], lens) + off] = np.repeat(moves[:, 1], lens) + off
        self.where = {s: [dest[np.concatenate(w)]] for s, w in self.where.items()}
        self.free_mask = self.cells.pos == EMPTY
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
        first = np.cumsum(n) - n
        self._put(idx, np.repeat(p0 - first, n) + np.arange(len(idx)), np.repeat(BITS[seq], n))
        for s, f, k in zip(seq.tolist(), first.tolist(), n.tolist(), strict=True):
            self.where.setdefault(s, []).append(idx[f : f + k])
        self._taken(idx)

    def _put(self, idx: np.ndarray, pos: np.ndarray, bits: np.ndarray) -> None:
        """KVCells.apply on free cells (its sliding-window reuse never applies here)."""
        c = self.cells
        c.pos[idx], c.seq[idx], c.shift[idx] = pos, bits, 0
        c.head = int(idx[-1]) + 1 if int(idx[-1]) + 1 < c.size else 0

    def _taken(self, idx: np.ndarray) -> None:
        self.free_mask[idx] = False
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
        self._put(got.ravel(), p.ravel(), np.tile(BITS[seqs], j))
        for i, s in enumerate(seqs):
            self.where.setdefault(s, []).append(got[:, i])
        span0 = self.span
        self._taken(got.ravel())
        used = self.used - n * (j - 1 - np.arange(j))
        self.track.steps(t, used, np.maximum(span0, np.maximum.accumulate(got.max(axis=1)) + 1))
        return j

    # -- sequence ops ---------------------------------------------------------------------------
    def free(self, t: int, seq: int, lo: int = 0, hi: int = INF) -> None:
        """seq_rm(seq, lo, hi) on the sequence's own cells (KVCells.seq_rm's semantics)."""
        w = self.where.pop(seq, None)
        if w:
            c = self.cells
            idx = np.concatenate(w)
            if (lo, hi) != (0, INF):  # a range: the sequence keeps its other cells
                p = c.pos[idx]
                hit = (p >= lo) & (p < hi)
                if not hit.all():
                    self.where[seq] = [idx[~hit]]
                idx = idx[hit]
            c.seq[idx] &= ~BITS[seq]
            gone = idx[c.seq[idx] == 0]
            if len(gone):
                c.pos[gone] = EMPTY
                c.shift[gone] = 0
                c.head = min(c.head, int(gone.min()))
                self.free_mask[gone] = True
                self.used -= len(gone)
                if int(gone.max()) + 1 == self.span:
                    u = np.flatnonzero(~self.free_mask[: self.span])
                    self.span = int(u[-1]) + 1 if len(u) else 0
        self._report(t)

    def share(self, t: int, src: int, dst: int, lo: int = 0, hi: int = INF) -> None:
        """seq_cp(src, dst, lo, hi) inside one stream: the cells gain the sequence (metadata only)."""
        w = self.where.get(src)
        if w:
            idx = np.concatenate(w)
            p = self.cells.pos[idx]
            idx = idx[(p >= lo) & (p < hi)]
            self.cells.seq[idx] |= BITS[dst]
            self.where.setdefault(dst, []).append(idx)
        self._report(t)
