"""KVCells and KVCache seq ops against a plain-Python model of the cells (tests/helpers/ref_memory.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvtool.errors import KvtoolError
from kvtool.memory.kv_cache import KVCache, KVCacheParams, KVLayerSpec
from kvtool.memory.kv_cells import KVCells, SWAParams, seq_bit
from tests.helpers.ref_memory import RefMemory, Tok

INF = 2**31 - 1


def seqs_of(mask: int) -> set[int]:
    return {s for s in range(64) if mask >> s & 1}


Row = tuple[int, int, tuple[int, ...], int]  # tag, pos, seqs, rotated


def observed(cache: KVCache, stream: int) -> dict[int, Row]:
    """Per used cell of the stream: its row. The test writes (tag, position) into a token's K row
    and the fake RoPE moves that position, so K tells which token it is and where it is rotated
    for; the cell's pending shift must bring that to the cell's position."""
    cells, k = cache.cells[stream], cache.k[0][stream]  # k: [n_cells, 1, 2]
    out = {}
    for i in np.flatnonzero(cells.pos >= 0).tolist():
        tag, rot, pos = int(k[i, 0, 0]), int(k[i, 0, 1]), int(cells.pos[i])
        assert pos - rot == int(cells.shift[i]), "the pending shift must move K to the cell's position"
        out[i] = (tag, pos, tuple(sorted(seqs_of(int(cells.seq[i])))), rot)
    return out


def check_stream(cache: KVCache, ref: RefMemory, stream: int, where: str) -> None:
    """The same tokens; those whose cell the semantics fix sit in that cell."""
    got = observed(cache, stream)
    want = [(t.cell, (t.tag, t.pos, tuple(sorted(t.seqs)), t.rotated)) for t in ref.streams[stream]]
    assert sorted(got.values()) == sorted(row for _, row in want), where
    assert all(got.get(cell) == row for cell, row in want if cell is not None), where


def fake_rope(il: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Stands in for RoPE in the shift: moves the position stored in the K row by delta."""
    out = k.clone()
    out[:, :, 1] += delta.to(k.dtype)[:, None]
    return out


OPS = ["place"] * 5 + ["rm"] * 3 + ["cp"] * 3 + ["keep"] * 3 + ["add"] * 3 + ["div"] * 2 + ["update"] * 2


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("seed", range(50))
def test_seq_ops_match_plain_python_model(seed: int, unified: bool) -> None:
    """Random mixes of decodes (cells placed), seq ops and shift updates, in one shared stream or
    one stream per sequence: cell contents, K rows and positions follow the plain-Python model."""
    rng = random.Random(seed)
    n, n_seq = (48, 4) if unified else (10, 4)  # small streams: copies can run out of room
    cache = KVCache(
        {0: KVLayerSpec(1, 2, 2)}, KVCacheParams(n_cells=n, n_seq_max=n_seq, unified=unified), fake_rope
    )
    ref = RefMemory(n, n_seq, unified)
    tag = 0

    def place(s: int) -> None:
        nonlocal tag
        stream = cache.stream_of(s)
        free = np.flatnonzero(cache.cells[stream].pos < 0).tolist()
        if not free:
            return
        i = rng.choice(free)
        seqs = {s} | ({rng.randrange(n_seq)} if unified and rng.random() < 0.2 else set())
        pos = max([-1, *(p for q in seqs for p in ref.positions(q))]) + 1
        tag += 1
        cache.cells[stream].apply(
            np.array([i]), np.array([pos]), np.array([sum(1 << q for q in seqs)], dtype=np.uint64)
        )
        cache.k[0][stream, i, 0] = torch.tensor([tag, pos], dtype=torch.float32)
        ref.place(s, Tok(pos, pos, seqs, tag, i))

    for s in range(n_seq):
        for _ in range(rng.randint(3, 9)):
            place(s)
    for step in range(60):
        op = rng.choice(OPS)
        s = rng.randrange(-1 if op == "rm" else 0, n_seq)
        p0 = rng.choice([-1, rng.randrange(0, 10)])
        p1 = rng.choice([-1, rng.randrange(0, 12)])
        if op == "place":
            place(s)
        elif op == "rm":
            assert cache.seq_rm(s, p0, p1) is True
            ref.seq_rm(s, p0, p1)
        elif op == "cp":
            d = rng.randrange(n_seq)
            if ref.seq_cp(s, d, p0, p1):
                cache.seq_cp(s, d, p0, p1)
            else:
                with pytest.raises(KvtoolError, match="no room"):
                    cache.seq_cp(s, d, p0, p1)
        elif op == "keep":
            cache.seq_keep(s)
            ref.seq_keep(s)
        elif op == "add":
            d = rng.randint(-6, 6)
            cache.seq_add(s, p0, p1, d)
            ref.seq_add(s, p0, p1, d)
        elif op == "div":
            d = rng.randint(1, 3)
            cache.seq_div(s, p0, p1, d)
            ref.seq_div(s, p0, p1, d)
        elif op == "update":
            upd = cache.init_update()
            upd.apply()
            ref.update()
        where = f"step {step}: {op}({s}, {p0}, {p1})"
        for st in range(cache.n_stream):
            check_stream(cache, ref, st, where)
        for q in range(n_seq):
            ps = ref.positions(q)
            assert (cache.seq_pos_min(q), cache.seq_pos_max(q)) == (
                min(ps, default=-1),
                max(ps, default=-1),
            ), where


def test_pending_shift_accumulates() -> None:
    cells = KVCells(8)
    cells.apply(np.arange(4), np.arange(4), np.full(4, seq_bit(0)))
    cells.seq_add(0, 2, INF, 3)
    cells.seq_add(0, 0, INF, -1)
    assert cells.pos[:4].tolist() == [-1, 0, 4, 5]  # pos 0 pushed below zero is freed
    assert cells.shift[:4].tolist() == [0, -1, 2, 2]
    assert cells.has_shift


def test_find_slot_wraps_and_fills_holes() -> None:
    cells = KVCells(6)
    cells.apply(np.arange(6), np.arange(6), np.full(6, seq_bit(0)))
    assert cells.find_slot(1) is None
    cells.seq_rm(0, 1, 2)
    cells.seq_rm(0, 4, 5)
    got = cells.find_slot(2)
    assert got is not None and sorted(got.tolist()) == [1, 4]
    assert cells.find_slot(3) is None


def test_find_slot_reuses_cells_outside_the_window() -> None:
    cells = KVCells(4)
    cells.apply(np.arange(4), np.arange(4), np.full(4, seq_bit(0)))
    swa = SWAParams(n_swa=2)
    # the next position is 4: positions 0, 1, 2 are outside a window of 2 (4 - p >= 2)
    got = cells.find_slot(3, swa)
    assert got is not None and sorted(got.tolist()) == [0, 1, 2]
    assert cells.find_slot(4, swa) is None
    assert cells.find_slot(1) is None  # without a window nothing is free


def test_cross_stream_copy_copies_rows() -> None:
    import torch

    cache = KVCache({0: KVLayerSpec(1, 2, 2)}, KVCacheParams(n_cells=8, n_seq_max=2, unified=False), None)
    c0 = cache.cells[0]
    c0.apply(np.arange(3), np.arange(3), np.full(3, seq_bit(0)))
    cache.k[0][0, :3] = torch.arange(6.0).view(3, 1, 2)
    cache.seq_cp(0, 1, -1, -1)
    assert cache.seq_pos_min(1) == 0 and cache.seq_pos_max(1) == 2
    assert torch.equal(cache.k[0][1, :3], cache.k[0][0, :3])
    # a partial copy into a stream that already holds cells lands in free cells
    cache.seq_rm(1, 2, -1)
    cache.seq_cp(0, 1, 2, 3)
    assert cache.seq_pos_max(1) == 2
    assert cache.cells[1].n_used() == 3


def test_cross_stream_copy_without_room_changes_nothing() -> None:
    cache = KVCache({0: KVLayerSpec(1, 2, 2)}, KVCacheParams(n_cells=4, n_seq_max=2, unified=False), None)
    for s in (0, 1):
        cache.cells[s].apply(np.arange(3), np.arange(3), np.full(3, seq_bit(s)))
        cache.k[0][s, :3] = s + 1.0
    before = [(c.pos.copy(), c.seq.copy()) for c in cache.cells], cache.k[0].clone()
    with pytest.raises(KvtoolError, match="no room"):
        cache.seq_cp(0, 1, 0, 2)  # two cells wanted, one free
    assert all(
        np.array_equal(c.pos, p) and np.array_equal(c.seq, q)
        for c, (p, q) in zip(cache.cells, before[0], strict=True)
    )
    assert torch.equal(cache.k[0], before[1])
