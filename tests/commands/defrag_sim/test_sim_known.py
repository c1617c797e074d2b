"""Hand-made workloads with known answers, and checks of the series against independent
counts (a plain-Python replay of token counts, and the cell map)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtool.commands.defrag_sim.names import POLICIES
from kvtool.commands.defrag_sim.policies import Policy
from kvtool.commands.defrag_sim.simulator import Geometry, simulate, split_ops
from kvtool.commands.defrag_sim.workload import (
    Decode,
    Free,
    LengthDist,
    Op,
    Run,
    SyntheticParams,
    Workload,
    synthetic,
)


def wl(ops: list[Op], n_seq: int) -> Workload:
    n_steps = max(op.t + (op.k if isinstance(op, Run) else 1) for op in ops)
    return Workload(tuple(ops), n_steps, n_seq, n_seq, "hand-made")


# 8 cells: four sequences of 2, then the 1st and 3rd leave two 2-cell holes; a 4-token prompt
FRAGMENTING = wl(
    [Decode(0, ((0, 2), (1, 2), (2, 2), (3, 2))), Free(1, 0), Free(1, 2), Decode(1, ((4, 4),))], 5
)


def sim(w: Workload, name: str, n_ctx: int, unified: bool = True, **kw: object):  # type: ignore[no-untyped-def]
    return simulate(w, Policy(name, **kw), Geometry(n_ctx, w.n_seq, unified, 512), n_map=w.n_steps + 1)  # type: ignore[arg-type]


def test_fragmented_contiguous_cache_fails_without_compaction() -> None:
    r = sim(FRAGMENTING, "contiguous", 8)
    assert (r.stats.failed_allocs, r.stats.dropped, r.stats.compactions) == (1, 1, 0)
    assert r.used.tolist() == [8, 4] and r.nkv.tolist() == [8, 8]


def test_on_fail_compaction_makes_room() -> None:
    r = sim(FRAGMENTING, "on-fail", 8, max_moves=8)
    st = r.stats
    # used cells 2, 3, 6, 7: one move of cells 6-7 into the hole at 0-1, then the prompt at 4-7
    assert (st.failed_allocs, st.dropped, st.compactions, st.passes, st.moves, st.cells_moved) == (
        0,
        0,
        1,
        1,
        1,
        2,
    )
    assert r.used.tolist() == [8, 8] and r.compacted_at == [1]
    assert r.cell_map[-1].tolist() == [3, 3, 1, 1, 4, 4, 4, 4]


def test_threshold_compacts_before_the_decode() -> None:
    assert sim(FRAGMENTING, "threshold", 8, defrag_thold=0.6).stats.failed_allocs == 1  # holes are 50%
    r = sim(FRAGMENTING, "threshold", 8, defrag_thold=0.4)
    assert (r.stats.failed_allocs, r.stats.compactions, r.stats.cells_moved) == (0, 1, 2)


def test_non_contiguous_and_paged_fit_the_prompt_into_the_holes() -> None:
    r = sim(FRAGMENTING, "non-contiguous", 8)
    assert r.stats.failed_allocs == 0 and r.cell_map[-1].tolist() == [4, 4, 1, 1, 4, 4, 3, 3]
    r = sim(FRAGMENTING, "paged", 8, page_size=2)
    assert r.stats.failed_allocs == 0 and r.used.tolist() == [8, 8] and r.nkv.tolist() == [8, 8]


def test_non_contiguous_n_kv_counts_the_holes() -> None:
    # 0: seq 0 and 1 take 3 cells each; 1: seq 0 leaves; then seq 1 generates 4 tokens
    w = wl([Decode(0, ((0, 3), (1, 3))), Free(1, 0), Run(1, (1,), 4)], 2)
    r = sim(w, "non-contiguous", 8)
    # the new tokens fill the hole from cell 0 (the head went back to the freed cells) and then cell 6
    assert r.used.tolist() == [6, 4, 5, 6, 7]
    assert r.nkv.tolist() == [6, 6, 6, 6, 7]
    assert (r.nkv - r.used).tolist() == [0, 2, 1, 0, 0]


def _token_counts(w: Workload) -> np.ndarray:
    """[n_steps, n_seq] each sequence's tokens after each step, replayed in plain Python."""
    out = np.zeros((w.n_steps, w.n_seq), dtype=np.int64)
    cur = [0] * w.n_seq
    t_done = 0
    for op in w.ops:
        for t in range(t_done, op.t):
            out[t] = cur
        t_done = max(t_done, op.t)
        if isinstance(op, Free):
            cur[op.seq] = 0
        elif isinstance(op, Decode):
            for s, n in op.parts:
                cur[s] += n
            out[op.t] = cur
            t_done = op.t + 1
        elif isinstance(op, Run):
            for t in range(op.t, op.t + op.k):
                for s in op.seqs:
                    cur[s] += 1
                out[t] = cur
            t_done = op.t + op.k
    for t in range(t_done, w.n_steps):
        out[t] = cur
    return out


def _workload(seed: int, clients: int = 6) -> Workload:
    p = SyntheticParams(
        clients, 80, "closed", 0.5, LengthDist("uniform", 40), LengthDist("exp", 30), 4096, seed
    )
    return synthetic(p)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_paged_never_fails_below_capacity_and_wastes_the_page_tails(seed: int, unified: bool) -> None:
    w = _workload(seed)
    tok = _token_counts(w)
    ps = 16
    pages = -(-tok // ps)  # [n_steps, n_seq]
    n_ctx = int(pages.sum(axis=1).max()) * ps if unified else int(pages.max()) * ps * w.n_seq
    r = sim(w, "paged", n_ctx, unified, page_size=ps)
    assert r.stats.failed_allocs == 0 and r.stats.dropped == 0
    assert r.used.tolist() == tok.sum(axis=1).tolist()
    assert (r.nkv - r.used).tolist() == (pages * ps - tok).sum(axis=1).tolist()
    # one cell less in a stream and some step no longer fits
    tight = sim(w, "paged", n_ctx - (1 if unified else w.n_seq) * ps, unified, page_size=ps)
    assert tight.stats.failed_allocs > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_non_contiguous_never_fails_below_capacity_and_n_kv_is_used_plus_holes(seed: int) -> None:
    w = _workload(seed)
    tok = _token_counts(w)
    n_ctx = int(tok.sum(axis=1).max())
    r = sim(w, "non-contiguous", n_ctx)
    assert r.stats.failed_allocs == 0 and r.used.tolist() == tok.sum(axis=1).tolist()
    # a cell map column shows the cells after the ops up to its step (a run all the way):
    # n_kv is the span of the used cells there, used plus the holes in it
    n_checked = 0
    for i, m in enumerate(r.map_steps.tolist()):
        done = [op for op in w.ops if op.t <= m]
        e = max(op.t + (op.k if isinstance(op, Run) else 1) for op in done if not isinstance(op, Free)) - 1
        if any(op.t > e for op in done):
            continue  # a free after the last decode shown: no step holds that state
        used = np.flatnonzero(r.cell_map[i] >= 0)
        span = int(used[-1]) + 1 if len(used) else 0
        assert (r.nkv[e], r.used[e]) == (span, len(used))
        n_checked += 1
    assert n_checked > len(r.map_steps) // 2
    assert np.all(r.nkv >= r.used) and r.holes_pct > 0
    assert sim(w, "non-contiguous", n_ctx - 1).stats.failed_allocs > 0


@pytest.mark.parametrize("name", POLICIES)
def test_split_streams_replay_each_sequence_alone(name: str) -> None:
    w = _workload(4)
    per = split_ops(w)
    tok = _token_counts(w)
    assert all(
        all(getattr(op, "seq", s) == s for op in ops if isinstance(op, Free)) for s, ops in enumerate(per)
    )
    r = sim(w, name, 256 * w.n_seq, unified=False)  # 256 cells per stream hold every request
    assert r.stats.failed_allocs == 0 and r.used.tolist() == tok.sum(axis=1).tolist()
    if name != "paged":  # one sequence per stream, freed whole: no holes, nothing to compact
        assert r.nkv.tolist() == r.used.tolist() and r.stats.compactions == 0


@pytest.mark.parametrize("name", ["non-contiguous", "on-fail", "threshold"])
def test_stream_bookkeeping_matches_kvcells(name: str) -> None:
    """The stream's own free path, counters and per-sequence cells against KVCells' seq_rm and
    plain counts, after every op of a busy unified replay with copies and compactions."""
    from kvtool.commands.defrag_sim.policies import CellStream
    from kvtool.commands.defrag_sim.series import Series, Stats

    w = _workload(7, clients=8)
    st = CellStream(1024, Policy(name, defrag_thold=0.2, max_moves=5), Stats(), Series(w.n_steps).track())
    pos = np.zeros(8, dtype=np.int64)
    for op in w.ops:
        if isinstance(op, Free):
            ref = st.cells.copy()
            ref.seq_rm(op.seq, 0, 1 << 62)
            st.free(op.t, op.seq)
            assert np.array_equal(ref.pos, st.cells.pos) and np.array_equal(ref.seq, st.cells.seq)
            assert ref.head == st.cells.head
            pos[op.seq] = 0
            if op.seq == 3 and 5 in st.where:
                st.share(op.t, 5, 3)  # seq 3 now shares seq 5's cells (freed with the next free of 3)
        elif isinstance(op, Decode):
            st.before_decode(op.t)
            st.place(op.t, [(s, int(pos[s]), n) for s, n in op.parts])
            for s, n in op.parts:
                pos[s] += n
        elif isinstance(op, Run):
            st.before_decode(op.t)
            j = st.run(op.t, list(op.seqs), pos, op.k)
            pos[list(op.seqs)] += j
        used = np.flatnonzero(st.cells.pos != -1)
        assert st.used == len(used) and st.span == (int(used[-1]) + 1 if len(used) else 0)
        assert np.array_equal(st.free_mask, st.cells.pos == -1)
        for s, cells in st.where.items():
            idx = np.concatenate(cells) if cells else np.empty(0, np.int64)
            assert sorted(idx.tolist()) == np.flatnonzero(st.cells.has_seq(s)).tolist()
    assert name == "non-contiguous" or st.stats.compactions > 0
