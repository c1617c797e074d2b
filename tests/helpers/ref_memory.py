"""A plain-Python model of the KV cells' semantics, the reference of the memory tests.

llama.cpp's semantics as docs/memory.md states them. Where they differ the docs win: in split
mode seq_keep(s) frees every other stream (llama.cpp's llama_kv_cache::seq_keep only visits the
stream of s), and a partial cross-stream seq_cp is allowed (llama.cpp asserts).
"""

from __future__ import annotations

from dataclasses import dataclass

INF = 2**31 - 1  # an open upper bound


@dataclass
class Tok:
    """A cached token: its position, the position its K row was rotated for (the pending shift
    must be pos - rotated), the sequences sharing it, a tag written into its K row, and its cell
    index where the semantics fix it (None after a partial cross-stream copy, which may land in
    any free cell)."""

    pos: int
    rotated: int
    seqs: set[int]
    tag: int
    cell: int | None


class RefMemory:
    """A plain-Python model of llama.cpp's KV cell semantics (docs/memory.md): one stream shared by
    every sequence (unified), or one stream per sequence whose cells hold that sequence only."""

    def __init__(self, n_cells: int, n_seq: int, unified: bool) -> None:
        self.n_cells, self.unified = n_cells, unified
        self.streams: list[list[Tok]] = [[] for _ in range(1 if unified else n_seq)]

    def stream(self, s: int) -> list[Tok]:
        return self.streams[0 if self.unified else s]

    def _targets(self, s: int) -> list[list[Tok]]:
        return self.streams if s < 0 else [self.stream(s)]

    @staticmethod
    def _range(p0: int, p1: int) -> tuple[int, int]:
        return (0 if p0 < 0 else p0, INF if p1 < 0 else p1)

    def place(self, s: int, tok: Tok) -> None:
        self.stream(s).append(tok)

    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        lo, hi = self._range(p0, p1)
        for st in self._targets(s):
            for t in list(st):
                if lo <= t.pos < hi and (s < 0 or s in t.seqs):
                    t.seqs = set() if s < 0 else t.seqs - {s}
                    if not t.seqs:
                        st.remove(t)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> bool:
        """False when dst's stream has no room (the memory must then be unchanged)."""
        if src == dst:
            return True
        lo, hi = self._range(p0, p1)
        hit = [t for t in self.stream(src) if src in t.seqs and lo <= t.pos < hi]
        if self.unified:
            for t in hit:
                t.seqs.add(dst)
            return True
        # across streams the cells are copied, with their K rows and pending shifts
        dst_stream = self.stream(dst)
        whole = p0 < 0 and p1 < 0
        if whole:
            dst_stream.clear()  # a whole copy replaces dst's stream, cell for cell (as llama.cpp)
        elif self.n_cells - len(dst_stream) < len(hit):
            return False
        for t in hit:
            dst_stream.append(Tok(t.pos, t.rotated, {dst}, t.tag, t.cell if whole else None))
        return True

    def seq_load(self, src: int, dst: int) -> None:
        """A state of sequence src loaded into dst: dst's cells are replaced by copies of src's
        (positions and pending shifts kept), in cells of dst's own."""
        saved = [Tok(t.pos, t.rotated, {dst}, t.tag, None) for t in self.stream(src) if src in t.seqs]
        self.seq_rm(dst, -1, -1)
        self.stream(dst).extend(saved)

    def seq_keep(self, s: int) -> None:
        for st in self.streams:
            st[:] = [t for t in st if s in t.seqs]
            for t in st:
                t.seqs = {s}

    def seq_add(self, s: int, p0: int, p1: int, d: int) -> None:
        lo, hi = self._range(p0, p1)
        st = self.stream(s)
        for t in list(st):
            if s in t.seqs and lo <= t.pos < hi:
                t.pos += d
                if t.pos < 0:
                    st.remove(t)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        lo, hi = self._range(p0, p1)
        for t in self.stream(s):
            if s in t.seqs and lo <= t.pos < hi:
                t.pos //= d

    def update(self) -> None:
        """The pending shifts are applied: every K row is now rotated for its position."""
        for st in self.streams:
            for t in st:
                t.rotated = t.pos

    def positions(self, s: int) -> list[int]:
        return [t.pos for t in self.stream(s) if s in t.seqs]
