"""Replays a workload's ops on the streams of one policy and KV mode.

`-kvu` (unified): one stream of n_ctx cells shared by every sequence, whose ubatches mix
sequences. Default: one stream of n_ctx // n_seq cells per sequence (llama.cpp's split KV).
A ubatch that finds no room is retried one sequence at a time; a sequence that finds no room
even alone has its request dropped (cells freed, its later tokens skipped until its free).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from kvtool.commands.defrag_sim.held import Held, pos_range
from kvtool.commands.defrag_sim.paged import PagedStream
from kvtool.commands.defrag_sim.policies import CellStream, Policy
from kvtool.commands.defrag_sim.series import Series, Stats
from kvtool.commands.defrag_sim.workload import Copy, Decode, Free, Op, Run, Workload
from kvtool.common.cells import KVCells

Stream: TypeAlias = CellStream | PagedStream


@dataclass(frozen=True)
class Geometry:
    """The cache being replayed: n_ctx cells in one stream, or split in n_seq equal streams."""

    n_ctx: int
    n_seq: int
    unified: bool
    n_ubatch: int = 512

    @property
    def n_stream(self) -> int:
        return 1 if self.unified else self.n_seq

    @property
    def stream_size(self) -> int:
        return self.n_ctx if self.unified else self.n_ctx // self.n_seq


@dataclass
class SimResult:
    """One policy's replay: counters, the per-step series and the cell map."""

    policy: Policy
    stats: Stats
    used: np.ndarray  # [n_steps] cells holding tokens
    nkv: np.ndarray  # [n_steps] attended cells (the used span per stream, or whole pages)
    capacity: int
    map_steps: np.ndarray  # [n_map] the cell map's columns: the cells after these steps' ops
    cell_map: np.ndarray  # [n_map, cells of all streams] owner per cell: seq, -1 free, -2 page tail
    compacted_at: list[int] = field(default_factory=list)
    first_compaction: KVCells | None = None  # a stream's cells just before its first compaction

    @property
    def holes_pct(self) -> float:
        tot = int(self.nkv.sum())
        return 100.0 * (tot - int(self.used.sum())) / tot if tot else 0.0


def simulate(
    w: Workload, policy: Policy, geo: Geometry, n_map: int = 0, per_seq: list[list[Op]] | None = None
) -> SimResult:
    """Replays `w` under `policy`; deterministic for a given workload. Split streams are
    independent, so each replays its own sequence's ops alone (`split_ops(w)`, computed here
    unless given), its generation merged into one run per request. `n_map` cell-map columns."""
    stats = Stats()
    series = Series(w.n_steps)
    map_steps = (
        np.unique(np.linspace(0, max(w.n_steps - 1, 0), n_map).astype(np.int64))
        if n_map
        else np.empty(0, np.int64)
    )
    maps = []
    compacted: list[int] = []
    first: KVCells | None = None
    if not geo.unified and per_seq is None:
        per_seq = split_ops(w)
    jobs = [(list(w.ops), w.n_seq)] if geo.unified else [(o, w.n_seq) for o in per_seq or []]
    for ops, n_seq in jobs:
        cls = PagedStream if policy.name == "paged" else CellStream
        st = cls(geo.stream_size, policy, stats, series.track())
        maps.append(_replay(st, ops, n_seq, geo.n_ubatch, stats, map_steps))
        st.track.hold(w.n_steps)
        compacted += st.compacted_at
        if first is None and isinstance(st, CellStream):
            first = st.first_compaction
    used, nkv = series.arrays()
    per = (
        geo.stream_size // policy.page_size * policy.page_size if policy.name == "paged" else geo.stream_size
    )
    return SimResult(
        policy,
        stats,
        used,
        nkv,
        per * geo.n_stream,
        map_steps,
        np.concatenate(maps, axis=1),
        sorted(compacted),
        first,
    )


def split_ops(w: Workload) -> list[list[Op]]:
    """Each sequence's own ops, for its own stream; a copy becomes an allocation of as many
    tokens as the source holds in the copied range at that time (as the workload defines it,
    before any drop)."""
    per: list[list[Op]] = [[] for _ in range(w.n_seq)]
    held = Held()  # each sequence's positions in the workload

    def add_run(s: int, t: int, k: int) -> None:
        last = per[s][-1] if per[s] else None
        if isinstance(last, Run) and last.t + last.k == t:
            per[s][-1] = Run(last.t, (s,), last.k + k)
        else:
            per[s].append(Run(t, (s,), k))
        held.append(s, k)

    for op in w.ops:
        if isinstance(op, Free):
            per[op.seq].append(op)
            held.remove(op.seq, *pos_range(op.p0, op.p1))
        elif isinstance(op, Copy):
            n = held.copy(op.src, op.seq, *pos_range(op.p0, op.p1))
            if n:
                per[op.seq].append(Decode(op.t, ((op.seq, n),)))
        elif isinstance(op, Decode):
            for s, k in op.parts:
                if k == 1:
                    add_run(s, op.t, 1)
                else:
                    per[s].append(Decode(op.t, ((s, k),)))
                    held.append(s, k)
        else:
            for s in op.seqs:
                add_run(s, op.t, op.k)
    return per


def _replay(
    st: Stream, ops: list[Op], n_seq: int, n_ub: int, stats: Stats, map_steps: np.ndarray
) -> np.ndarray:
    """Replays ops on one stream; returns its cell map [len(map_steps), stream size]."""
    pos = np.zeros(max(n_seq, 1), dtype=np.int64)  # next position of each sequence
    dropped: set[int] = set()
    cell_map = np.empty((len(map_steps), st.size), dtype=np.int16)
    i_map = 0

    def drop(t: int, seqs: list[int]) -> None:
        for s in seqs:
            stats.dropped += 1
            dropped.add(s)
            st.free(t, s)

    def place(t: int, parts: list[tuple[int, int]]) -> None:
        """One step's tokens, in ubatches of at most n_ubatch."""
        ps = []
        for s, n in parts:
            if s not in dropped:
                ps.append((s, int(pos[s]), n))
                pos[s] += n
        if ps:
            st.before_decode(t)
            for ub in _ubatches(ps, n_ub):
                ub = [p for p in ub if p[0] not in dropped]  # dropped by an earlier ubatch
                if ub:
                    drop(t, st.place(t, ub))

    for op in ops:
        while i_map < len(map_steps) and map_steps[i_map] < op.t:  # the state after step m
            cell_map[i_map] = st.owners()
            i_map += 1
        if isinstance(op, Free):
            lo, hi = pos_range(op.p0, op.p1)
            st.free(op.t, op.seq, lo, hi)
            if op.whole:
                dropped.discard(op.seq)
                pos[op.seq] = 0
            elif hi >= pos[op.seq]:  # the tail went: the sequence continues where it was cut
                pos[op.seq] = min(int(pos[op.seq]), lo)
        elif isinstance(op, Copy):
            lo, hi = pos_range(op.p0, op.p1)
            pos[op.seq] = pos[op.src] if op.whole else max(pos[op.seq], min(int(pos[op.src]), hi))
            if op.src not in dropped and op.seq not in dropped and isinstance(st, CellStream):
                st.share(op.t, op.src, op.seq, lo, hi)
            elif op.src not in dropped and isinstance(st, PagedStream):  # the copy takes its own pages
                n = st.held.count(op.src, lo, hi)
                if n:
                    drop(op.t, st.place(op.t, [(op.seq, int(pos[op.seq]) - n, n)]))
        elif isinstance(op, Decode):
            place(op.t, list(op.parts))
        else:
            _run(st, op.t, list(op.seqs), op.k, pos, dropped, place, n_ub)
    if i_map < len(map_steps):
        cell_map[i_map:] = st.owners()
    return cell_map


def _ubatches(parts: list[tuple[int, int, int]], n_ubatch: int) -> list[list[tuple[int, int, int]]]:
    """Cuts (seq, pos, n) parts, in batch order, into ubatches of at most n_ubatch tokens."""
    out: list[list[tuple[int, int, int]]] = [[]]
    room = n_ubatch
    for s, p, n in parts:
        while n:
            if not room:
                out.append([])
                room = n_ubatch
            m = min(n, room)
            out[-1].append((s, p, m))
            p, n, room = p + m, n - m, room - m
    return out


def _run(
    st: Stream,
    t: int,
    seqs: list[int],
    k: int,
    pos: np.ndarray,
    dropped: set[int],
    place: Callable[[int, list[tuple[int, int]]], None],
    n_ub: int,
) -> None:
    """k steps of one token per sequence on one stream: as many at once as fit, then the
    failing step through `place` (compaction, one-by-one retry, drops), and on."""
    end = t + k
    seqs = [s for s in seqs if s not in dropped]
    if seqs:
        st.before_decode(t)
    while t < end and seqs:
        j = st.run(t, seqs, pos, end - t) if len(seqs) <= n_ub else 0
        pos[seqs] += j
        t += j
        if t < end:
            place(t, [(s, 1) for s in seqs])
            seqs = [s for s in seqs if s not in dropped]
            t += 1
