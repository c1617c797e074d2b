"""The compaction planner against the math: after the plan, used cells are a prefix, every
cell's (pos, sequences, shift) survives, passes respect max_moves, and executing a pass's
moves one by one on a data array (in any order) reads no overwritten source."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from kvtool.memory.defrag import apply_defrag, apply_defrag_moves, plan_defrag
from kvtool.memory.kv_cells import EMPTY, KVCells, seq_bit


def _cells(layout: str) -> KVCells:
    """'ab.a..b': a letter is a used cell of sequence ord(letter) - 97, '.' a hole."""
    c = KVCells(len(layout))
    nxt: Counter[int] = Counter()
    for i, ch in enumerate(layout):
        if ch != ".":
            s = ord(ch) - 97
            c.pos[i], c.seq[i] = nxt[s], seq_bit(s)
            nxt[s] += 1
    return c


def _random_cells(rng: random.Random, size: int) -> KVCells:
    c = KVCells(size)
    for i in range(size):
        if rng.random() < 0.55:
            c.pos[i] = rng.randrange(1000)
            c.seq[i] = np.uint64(rng.randrange(1, 16))  # up to 4 sequences share a cell
            c.shift[i] = rng.randrange(-5, 6)
    return c


def _content(c: KVCells) -> Counter[tuple[int, int, int]]:
    u = c.pos != EMPTY
    return Counter(zip(c.pos[u].tolist(), c.seq[u].tolist(), c.shift[u].tolist(), strict=True))


def test_known_layout() -> None:
    c = _cells("a.b..ab.ba")
    plan = plan_defrag(c, max_moves=8)
    # 6 used cells: holes 1, 3, 4 take cells 6, 8, 9; (8, 9) -> (3, 4) is one block
    assert [m.tolist() for p in plan.passes for m in p] == [[6, 1, 1], [8, 3, 2]]
    assert (plan.n_passes, plan.n_moves, plan.n_cells) == (1, 2, 3)
    apply_defrag(c, plan)
    assert np.all(c.pos[:6] != EMPTY) and np.all(c.pos[6:] == EMPTY)
    assert c.head == 6


def test_packed_stream_needs_no_plan() -> None:
    c = _cells("aabb....")
    assert plan_defrag(c, 4).n_passes == 0
    assert plan_defrag(KVCells(8), 4).n_moves == 0


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("max_moves", [1, 3, 64])
def test_random_streams(seed: int, max_moves: int) -> None:
    rng = random.Random(seed)
    c = _random_cells(rng, rng.randrange(1, 300))
    before = _content(c)
    n_used = c.n_used()
    data = np.where(c.pos != EMPTY, np.arange(c.size), -1)  # stands for a K/V row: its origin
    origin = {int(i): (int(c.pos[i]), int(c.seq[i]), int(c.shift[i])) for i in np.flatnonzero(data >= 0)}
    plan = plan_defrag(c, max_moves)
    for moves in plan.passes:
        assert 1 <= len(moves) <= max_moves
        assert np.all(moves[:, 2] >= 1)
        written: set[int] = set()
        for src, dst, n in rng.sample(moves.tolist(), len(moves)):  # any order within a pass
            assert not written & set(range(src, src + n)), "a move reads a cell written in this pass"
            data[dst : dst + n] = data[src : src + n]
            data[src : src + n] = -1
            written |= set(range(dst, dst + n))
        apply_defrag_moves(c, moves)
    assert np.all(c.pos[:n_used] != EMPTY) and np.all(c.pos[n_used:] == EMPTY)
    assert _content(c) == before
    # the data moved exactly as the metadata did
    for i in range(n_used):
        assert origin[int(data[i])] == (int(c.pos[i]), int(c.seq[i]), int(c.shift[i]))
    assert plan.n_cells == int(np.count_nonzero(data[:n_used] != np.arange(n_used)))


def test_max_moves_must_be_positive() -> None:
    with pytest.raises(ValueError):
        plan_defrag(KVCells(4), 0)
