"""Cell bookkeeping of one KV stream (llama.cpp's llama_kv_cells): numpy only, no tensors.

A cell holds one token: its position, the set of sequences that share it (a 64-bit mask) and
a pending position shift (applied to K by the next memory update).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY = -1
_ONE = np.uint64(1)


def seq_bit(seq_id: int) -> np.uint64:
    return _ONE << np.uint64(seq_id)


@dataclass(frozen=True)
class SWAParams:
    """Sliding window: a query at p1 sees a key at p0 iff not masked (llama_hparams::is_masked_swa)."""

    n_swa: int
    kind: str = "standard"  # standard | chunked | symmetric

    def masked(self, p0: np.ndarray, p1: np.ndarray) -> np.ndarray:
        if self.kind == "chunked":
            return p0 < (p1 // self.n_swa) * self.n_swa
        if self.kind == "symmetric":
            half = self.n_swa // 2
            return (p0 < p1 - half) | (p0 > p1 + half)
        return p1 - p0 >= self.n_swa


class KVCells:
    """The cells of one stream."""

    EMPTY = EMPTY  # the position of an empty cell
    CELL_BYTES = 24  # a cell's position, sequence set and pending shift: 8 bytes each

    def nbytes(self) -> int:
        """Bytes of this stream's bookkeeping."""
        return self.pos.nbytes + self.seq.nbytes + self.shift.nbytes

    def __init__(self, size: int) -> None:
        self.size = size
        self.pos = np.full(size, EMPTY, dtype=np.int64)  # [size]
        self.seq = np.zeros(size, dtype=np.uint64)  # [size] sequence bitset
        self.shift = np.zeros(size, dtype=np.int64)  # [size] pending K shift
        self.has_shift = False
        self.head = 0

    def copy(self) -> KVCells:
        c = KVCells.__new__(KVCells)
        c.size, c.has_shift, c.head = self.size, self.has_shift, self.head
        c.pos, c.seq, c.shift = self.pos.copy(), self.seq.copy(), self.shift.copy()
        return c

    def restore(self, saved: KVCells) -> None:
        """Takes back the bookkeeping of `saved` (a copy of these cells made earlier)."""
        self.pos[:], self.seq[:], self.shift[:] = saved.pos, saved.seq, saved.shift
        self.has_shift, self.head = saved.has_shift, saved.head

    def reset(self) -> None:
        self.pos.fill(EMPTY)
        self.seq.fill(0)
        self.shift.fill(0)
        self.has_shift = False
        self.head = 0

    # -- queries --------------------------------------------------------------------------------
    def used(self) -> np.ndarray:
        return self.pos != EMPTY

    def n_used(self) -> int:
        return int(np.count_nonzero(self.pos != EMPTY))

    def used_max_p1(self) -> int:
        nz = np.flatnonzero(self.pos != EMPTY)
        return int(nz[-1]) + 1 if nz.size else 0

    def has_seq(self, seq_id: int) -> np.ndarray:
        return (self.seq & seq_bit(seq_id)) != 0

    def seq_pos_min(self, seq_id: int) -> int:
        p = self.pos[self.has_seq(seq_id)]
        return int(p.min()) if p.size else -1

    def seq_pos_max(self, seq_id: int) -> int:
        p = self.pos[self.has_seq(seq_id)]
        return int(p.max()) if p.size else -1

    def seq_pos_max_all(self) -> np.ndarray:
        """[64] the last position of every sequence id (-1 when absent)."""
        out = np.full(64, -1, dtype=np.int64)
        for s in self.seq_ids():
            out[s] = self.seq_pos_max(s)
        return out

    def _seqs_of(self, cells: np.ndarray) -> list[int]:
        bits = int(np.bitwise_or.reduce(self.seq[cells])) if len(cells) else 0
        out = []
        while bits:  # one step per sequence present, not per possible id
            low = bits & -bits
            out.append(low.bit_length() - 1)
            bits ^= low
        return out

    def seq_ids(self) -> list[int]:
        """Sequence ids present in this stream."""
        return self._seqs_of(np.flatnonzero(self.seq))

    # -- mutation -------------------------------------------------------------------------------
    def _free(self, cells: np.ndarray) -> None:
        self.pos[cells] = EMPTY
        self.seq[cells] = 0
        self.shift[cells] = 0
        idx = np.flatnonzero(cells) if cells.dtype == bool else cells
        if len(idx):
            self.head = min(self.head, int(np.min(idx)))

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> None:
        """Remove the sequence (every sequence when seq_id < 0) from cells with p0 <= pos < p1."""
        in_range = (self.pos >= p0) & (self.pos < p1) & (self.pos != EMPTY)
        if seq_id < 0:
            self._free(in_range)
            return
        hit = in_range & self.has_seq(seq_id)
        self.seq[hit] &= ~seq_bit(seq_id)
        self._free(hit & (self.seq == 0))

    def seq_keep(self, seq_id: int) -> None:
        keep = self.has_seq(seq_id)
        self.seq[keep] = seq_bit(seq_id)
        self._free(~keep & (self.pos != EMPTY))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions of the sequence's cells in [p0, p1) by delta; cells pushed below 0 are freed."""
        hit = self.has_seq(seq_id) & (self.pos >= p0) & (self.pos < p1)
        if not hit.any() or delta == 0:
            return
        self.has_shift = True
        self.pos[hit] += delta
        self.shift[hit] += delta
        self._free(hit & (self.pos < 0))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        hit = self.has_seq(seq_id) & (self.pos >= p0) & (self.pos < p1)
        if not hit.any() or d == 1:
            return
        self.has_shift = True
        old = self.pos[hit]
        new = old // d
        self.pos[hit] = new
        self.shift[hit] += new - old

    def find_slot(self, n: int, swa: SWAParams | None = None, contiguous: bool = False) -> np.ndarray | None:
        """Indices of n usable cells, searching from the head and wrapping (not necessarily
        contiguous; with `contiguous`, the first run of n usable cells at or after the head, else
        from cell 0, as llama.cpp before non-contiguous slots). A cell is usable if empty, or, in
        a sliding-window cache, if it holds one sequence and lies outside that sequence's window
        as seen from its next position."""
        if n > self.size:
            return None
        usable = self.pos == EMPTY
        if swa is not None:
            one = (self.seq != 0) & ((self.seq & (self.seq - _ONE)) == 0)
            if one.any():
                sid = np.zeros(self.size, dtype=np.int64)
                sid[one] = np.log2(self.seq[one].astype(np.float64)).astype(np.int64)
                pmax = self.seq_pos_max_all()
                usable |= one & swa.masked(self.pos, pmax[sid] + 1)
        head = self.head
        if head > self.n_used() + 2 * n:
            head = 0
        if contiguous:
            return self._find_run(usable, n, head)
        if head + n <= self.size and usable[head : head + n].all():
            return np.arange(head, head + n)  # the usual case: free cells right at the head
        order = np.roll(np.arange(self.size), -head) if head else np.arange(self.size)
        cand = order[usable[order]]
        if cand.size < n:
            return None
        return cand[:n]

    @staticmethod
    def _find_run(usable: np.ndarray, n: int, head: int) -> np.ndarray | None:
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        c = np.concatenate(([0], np.cumsum(usable, dtype=np.int64)))  # [size + 1]
        starts = np.flatnonzero(c[n:] - c[:-n] == n)  # runs of n usable cells
        if not starts.size:
            return None
        after = starts[starts >= head]
        first = int(after[0]) if after.size else int(starts[0])
        return np.arange(first, first + n, dtype=np.int64)

    def apply(self, idx: np.ndarray, pos: np.ndarray, seq_mask: np.ndarray) -> None:
        """Place tokens in cells `idx`. A reused sliding-window cell loses its old token, and its
        sequence loses every earlier position too, so positions stay contiguous per sequence."""
        old = idx[self.pos[idx] != EMPTY]
        for s in self._seqs_of(old) if len(old) else ():
            cut = int(self.pos[old][(self.seq[old] & seq_bit(s)) != 0].max())
            self.seq_rm(s, 0, cut + 1)
        self.pos[idx] = pos
        self.seq[idx] = seq_mask
        self.shift[idx] = 0
        if len(idx):
            self.head = int(idx[-1]) + 1 if int(idx[-1]) + 1 < self.size else 0

    def take_shift(self) -> np.ndarray:
        """The pending shifts, cleared (they are being applied to K now)."""
        s = self.shift.copy()
        self.shift.fill(0)
        self.has_shift = False
        return s
