"""KVCells and KVCache seq ops against a plain-Python model of the cells (llama.cpp's semantics)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtool.memory.kv_cache import KVCache, KVCacheParams, KVLayerSpec
from kvtool.memory.kv_cells import KVCells, SWAParams, seq_bit

INF = 2**31 - 1


def _no_rope(il, k, delta):  # type: ignore[no-untyped-def]
    return k  # the cell tests move positions; K rows are not looked at


class RefCells:
    """One dict per cell: {"pos": int, "seqs": set}, or None when empty."""

    def __init__(self, n: int) -> None:
        self.c: list[dict | None] = [None] * n

    def place(self, i: int, pos: int, seqs: set[int]) -> None:
        self.c[i] = {"pos": pos, "seqs": set(seqs)}

    def _range(self, p0: int, p1: int) -> tuple[int, int]:
        return (0 if p0 < 0 else p0, INF if p1 < 0 else p1)

    def seq_rm(self, s: int, p0: int, p1: int) -> None:
        lo, hi = self._range(p0, p1)
        for i, c in enumerate(self.c):
            if c and lo <= c["pos"] < hi:
                if s < 0:
                    self.c[i] = None
                elif s in c["seqs"]:
                    c["seqs"].discard(s)
                    if not c["seqs"]:
                        self.c[i] = None

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        lo, hi = self._range(p0, p1)
        for c in self.c:
            if c and src in c["seqs"] and lo <= c["pos"] < hi:
                c["seqs"].add(dst)

    def seq_keep(self, s: int) -> None:
        for i, c in enumerate(self.c):
            if c:
                if s in c["seqs"]:
                    c["seqs"] = {s}
                else:
                    self.c[i] = None

    def seq_add(self, s: int, p0: int, p1: int, d: int) -> None:
        lo, hi = self._range(p0, p1)
        if lo == hi:
            return
        for i, c in enumerate(self.c):
            if c and s in c["seqs"] and lo <= c["pos"] < hi:
                c["pos"] += d
                if c["pos"] < 0:
                    self.c[i] = None

    def seq_div(self, s: int, p0: int, p1: int, d: int) -> None:
        lo, hi = self._range(p0, p1)
        if lo == hi:
            return
        for c in self.c:
            if c and s in c["seqs"] and lo <= c["pos"] < hi:
                c["pos"] //= d

    def pos_min(self, s: int) -> int:
        ps = [c["pos"] for c in self.c if c and s in c["seqs"]]
        return min(ps) if ps else -1

    def pos_max(self, s: int) -> int:
        ps = [c["pos"] for c in self.c if c and s in c["seqs"]]
        return max(ps) if ps else -1


def snapshot(cells: KVCells) -> list[tuple[int, set[int]] | None]:
    out: list[tuple[int, set[int]] | None] = []
    for i in range(cells.size):
        if cells.pos[i] < 0:
            out.append(None)
        else:
            out.append((int(cells.pos[i]), {s for s in range(64) if int(cells.seq[i]) >> s & 1}))
    return out


def ref_snapshot(ref: RefCells) -> list[tuple[int, set[int]] | None]:
    return [None if c is None else (c["pos"], set(c["seqs"])) for c in ref.c]


@pytest.mark.parametrize("seed", range(20))
def test_seq_ops_match_plain_python_model(seed: int) -> None:
    rng = random.Random(seed)
    n, n_seq = 48, 4
    cache = KVCache(
        {0: KVLayerSpec(1, 4, 4)}, KVCacheParams(n_cells=n, n_seq_max=n_seq, unified=True), _no_rope
    )
    cells = cache.cells[0]
    ref = RefCells(n)
    # fill: each sequence gets consecutive positions in random free cells, some cells shared
    free = list(range(n))
    rng.shuffle(free)
    for s in range(n_seq):
        for p in range(rng.randint(3, 9)):
            i = free.pop()
            seqs = {s} | ({rng.randrange(n_seq)} if rng.random() < 0.2 else set())
            cells.apply(np.array([i]), np.array([p]), np.array([sum(1 << x for x in seqs)], dtype=np.uint64))
            ref.place(i, p, seqs)
    for _ in range(40):
        op = rng.choice(["rm", "cp", "keep", "add", "div"])
        s = rng.randrange(-1 if op == "rm" else 0, n_seq)
        p0 = rng.choice([-1, rng.randrange(0, 10)])
        p1 = rng.choice([-1, rng.randrange(0, 12)])
        if op == "rm":
            assert cache.seq_rm(s, p0, p1) is True
            ref.seq_rm(s, p0, p1)
        elif op == "cp":
            d = rng.randrange(n_seq)
            cache.seq_cp(s, d, p0, p1)
            if s != d:
                ref.seq_cp(s, d, p0, p1)
        elif op == "keep" and rng.random() < 0.2:
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
        assert snapshot(cells) == ref_snapshot(ref), op
        for q in range(n_seq):
            assert cache.seq_pos_min(q) == ref.pos_min(q)
            assert cache.seq_pos_max(q) == ref.pos_max(q)


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
