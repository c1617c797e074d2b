"""Plain-Python models of the memories' semantics, the references of the memory tests.

`RefMemory` models the KV cells, `RefRecurrent` the recurrent states. llama.cpp's semantics as
docs/memory.md states them. Where they differ the docs win: in split mode seq_keep(s) frees
every other stream (llama.cpp's llama_kv_cache::seq_keep only visits the stream of s), and a
partial cross-stream seq_cp is allowed (llama.cpp asserts).
"""

from __future__ import annotations

from dataclasses import dataclass

INF = 2**31 - 1  # an open upper bound


@dataclass
class Tok:
    """A cached token: its position, the position its K row was rotated for (the pending shift
    must be pos - rotated), the sequences sharing it, a tag written into its K row, and its cell
    index where the semantics fix it (None after a partial cross-stream copy, which may land in
    any free cell). `seen` is what the token attended to when it was decoded, (tag, pos) pairs
    in position order ending with itself: a deeper layer's K/V depend on all of it."""

    pos: int
    rotated: int
    seqs: set[int]
    tag: int
    cell: int | None
    seen: tuple[tuple[int, int], ...] = ()


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

    def decode(self, s: int, tag: int, pos: int) -> None:
        """A token decoded for sequence s at pos: it sees s's tokens before it, and itself."""
        before = sorted((t.pos, t.tag) for t in self.stream(s) if s in t.seqs and t.pos < pos)
        seen = (*((tg, p) for p, tg in before), (tag, pos))
        self.place(s, Tok(pos, pos, {s}, tag, None, seen))

    def tokens(self, s: int) -> list[Tok]:
        """s's tokens in position order."""
        return sorted((t for t in self.stream(s) if s in t.seqs), key=lambda t: (t.pos, t.tag))

    def faithful(self, s: int) -> bool:
        """Whether every token of s was computed over exactly the tokens s now holds before it
        (and still sits at the position it was computed at): then s's cache is what a fresh
        decode of its tokens computes, in every layer."""
        toks = self.tokens(s)
        pairs = [(t.tag, t.pos) for t in toks]
        return all(t.seen == (*pairs[:i], pairs[i]) and t.rotated == t.pos for i, t in enumerate(toks))

    def n_used(self) -> int:
        return sum(len(st) for st in self.streams)

    def n_free(self, s: int) -> int:
        return self.n_cells - len(self.stream(s))

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
            dst_stream.append(Tok(t.pos, t.rotated, {dst}, t.tag, t.cell if whole else None, t.seen))
        return True

    def seq_load(self, src: int, dst: int) -> None:
        """A state of sequence src loaded into dst: dst's cells are replaced by copies of src's
        (positions and pending shifts kept), in cells of dst's own."""
        saved = [Tok(t.pos, t.rotated, {dst}, t.tag, None, t.seen) for t in self.stream(src) if src in t.seqs]
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

    def pos_min_max(self, s: int) -> tuple[int, int]:
        ps = self.positions(s)
        return (min(ps), max(ps)) if ps else (-1, -1)


class RefSWA(RefMemory):
    """A base cache and a window cache of n_swa (SWAKVCache): both see every op, but the window
    cache may reuse a cell holding one sequence outside that sequence's window (and then
    forgets every earlier position of it; which cells the slot search reuses is its own
    business: `forget` follows it, `must_hold` bounds it), and a sequence state saved from it
    keeps only what the sequence's last position still sees. The memory reports the positions
    both caches hold: the window's."""

    def __init__(self, n_cells: int, n_seq: int, unified: bool, n_swa: int) -> None:
        super().__init__(n_cells, n_seq, unified)
        self.win = RefMemory(n_cells, n_seq, unified)
        self.n_swa = n_swa

    def decode(self, s: int, tag: int, pos: int) -> None:
        super().decode(s, tag, pos)
        self.win.place(s, Tok(pos, pos, {s}, tag, None))

    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        super().seq_rm(s, p0, p1)
        self.win.seq_rm(s, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> bool:
        return super().seq_cp(src, dst, p0, p1) and self.win.seq_cp(src, dst, p0, p1)

    def seq_load(self, src: int, dst: int) -> None:
        win = [Tok(t.pos, t.rotated, {dst}, t.tag, None) for t in self.win.stream(src) if src in t.seqs]
        last = max((t.pos for t in win), default=-1)
        super().seq_load(src, dst)  # clears dst in both caches (self.seq_rm)
        self.win.stream(dst).extend(t for t in win if last - t.pos < self.n_swa)  # what last still sees

    def seq_keep(self, s: int) -> None:
        super().seq_keep(s)
        self.win.seq_keep(s)

    def seq_add(self, s: int, p0: int, p1: int, d: int) -> None:
        super().seq_add(s, p0, p1, d)
        self.win.seq_add(s, p0, p1, d)

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        super().seq_div(s, p0, p1, d)
        self.win.seq_div(s, p0, p1, d)

    def pos_min_max(self, s: int) -> tuple[int, int]:
        (a0, a1), (b0, b1) = super().pos_min_max(s), self.win.pos_min_max(s)
        return max(a0, b0), min(a1, b1)

    def forget(self, s: int, p_min: int) -> None:
        """The window cache now starts s at p_min: what it may have forgotten is gone."""
        if p_min > 0:
            self.win.seq_rm(s, 0, p_min)

    def must_hold(self, s: int) -> int | None:
        """After a decode: the lowest of s's positions that its next token still sees (the
        window may have forgotten anything below), None when s is empty."""
        ps = self.win.positions(s)
        if not ps:
            return None
        return min(p for p in ps if p >= max(ps) + 2 - self.n_swa)


@dataclass
class RefState:
    """A sequence's recurrent state: the tokens folded into it, the position of the last, the
    rollback snapshots it may use, and the slot it lives in (shared after a copy until one of
    the sequences writes)."""

    hist: list[int]
    pos: int
    n_hist: int
    slot: int


class Refused(Exception):
    """The reference refuses the operation: the memory must refuse it and change nothing."""


class RefRecurrent:
    """A plain-Python model of a recurrent memory (kvtool.memory.recurrent): one state per
    sequence, `n_rs` rollback snapshots; only the state's last position counts for ranges."""

    def __init__(self, n_seq: int, n_rs: int) -> None:
        self.n_seq, self.n_rs = n_seq, n_rs
        self.seqs: dict[int, RefState] = {}
        self._slots = 0

    def _new_slot(self) -> int:
        self._slots += 1
        return self._slots

    def _own(self, s: int) -> RefState:
        st = self.seqs[s]
        if sum(o.slot == st.slot for o in self.seqs.values()) > 1:
            st.slot = self._new_slot()
        return st

    def _check(self, s: int) -> None:
        if not 0 <= s < self.n_seq:
            raise Refused(f"sequence {s} out of range")

    def decode(self, s: int, tags: list[int], p0: int) -> None:
        """len(tags) tokens of s from p0 (in any number of ubatches: the snapshot count adds up)."""
        had = s in self.seqs
        if not had:
            self.seqs[s] = RefState([], -1, -1, self._new_slot())
        st = self._own(s)
        st.n_hist = min(self.n_rs, len(tags) - 1 + (st.n_hist + 1 if had else 0))
        st.hist += tags
        st.pos = p0 + len(tags) - 1

    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        lo, hi = RefMemory._range(p0, p1)
        if s < 0:
            if lo == hi:
                return
            if (lo, hi) != (0, INF):
                raise Refused("a range of every sequence")
            self.seqs.clear()
            return
        self._check(s)
        st = self.seqs.get(s)
        if st is None or lo >= hi or lo > st.pos:
            return
        if hi <= st.pos:  # llama.cpp: only the state's position counts, and it is not in range
            return
        if lo == 0:
            del self.seqs[s]
            return
        r = st.pos - lo + 1
        if r > st.n_hist:
            raise Refused("no snapshot that far back")
        st = self._own(s)
        del st.hist[-r:]
        st.pos -= r
        st.n_hist -= r

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._check(src)
        self._check(dst)
        if src == dst:
            return
        st = self.seqs.get(src)  # the range is ignored (llama.cpp): the whole state is shared
        self.seqs.pop(dst, None)
        if st is not None:
            self.seqs[dst] = RefState(list(st.hist), st.pos, st.n_hist, st.slot)

    def seq_load(self, src: int, dst: int) -> None:
        """A sequence state of src loaded into dst: its tokens and position, no snapshots."""
        st = self.seqs.get(src)
        self.seqs.pop(dst, None)
        if st is not None:
            self.seqs[dst] = RefState(list(st.hist), st.pos, 0, self._new_slot())

    def loaded(self) -> None:
        """A whole-context state loaded: no snapshots, one slot each."""
        for st in self.seqs.values():
            st.n_hist, st.slot = 0, self._new_slot()

    def seq_keep(self, s: int) -> None:
        self._check(s)
        self.seqs = {k: v for k, v in self.seqs.items() if k == s}

    def seq_add(self, s: int, p0: int, p1: int, d: int) -> None:
        self._check(s)
        lo, hi = RefMemory._range(p0, p1)
        st = self.seqs.get(s)
        if st is not None and lo < hi and lo <= st.pos < hi:
            st.pos += d  # positions only: a state does not depend on them
            if st.pos < 0:  # as KV cells pushed below 0
                del self.seqs[s]

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        self._check(s)
        if d < 1:
            raise Refused("seq_div needs a divisor >= 1")
        lo, hi = RefMemory._range(p0, p1)
        st = self.seqs.get(s)
        if st is not None and lo < hi and lo <= st.pos < hi and d != 1:
            st.pos //= d
            st.n_hist = 0

    def clear(self) -> None:
        self.seqs.clear()

    def pos_min_max(self, s: int) -> tuple[int, int]:
        st = self.seqs.get(s)
        return (st.pos, st.pos) if st is not None else (-1, -1)

    def n_used(self) -> int:
        return len({st.slot for st in self.seqs.values()})
