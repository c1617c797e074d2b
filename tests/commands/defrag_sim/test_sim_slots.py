"""Slot searches against plain-Python models: the contiguous search replays llama.cpp's old
first-fit find_slot one ubatch at a time; the non-contiguous one is KVCells.find_slot."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtool.commands.defrag_sim.slots import (
    contiguous_slots,
    contiguous_slots_near,
    first_free,
    first_free_near,
    free_runs,
)
from kvtool.memory.kv_cells import KVCells


def ref_find_contiguous(free: list[bool], head: int, n: int) -> int | None:
    """One old llama.cpp contiguous search: windows from the head that do not cross the end,
    then from cell 0; gives up after testing as many cells as the stream has."""
    size, cur, tested = len(free), head, 0
    while tested < size:
        if cur + n > size:
            tested += size - cur
            cur = 0
            continue
        bad = next((i for i in range(n) if not free[cur + i]), None)
        if bad is None:
            return cur
        cur += bad + 1
        tested += bad + 1
    return None


def ref_slots(free: list[bool], head: int, n: int, count: int) -> list[int]:
    free = list(free)
    out: list[int] = []
    for _ in range(count):
        s = ref_find_contiguous(free, head, n)
        if s is None:
            break
        out.append(s)
        for i in range(s, s + n):
            free[i] = False
        head = s + n if s + n < len(free) else 0
    return out


@pytest.mark.parametrize("seed", range(300))
def test_contiguous_slots_match_successive_first_fit(seed: int) -> None:
    rng = random.Random(seed)
    size = rng.randrange(1, 60)
    free = [rng.random() < rng.choice([0.3, 0.6, 0.9]) for _ in range(size)]
    head, n, count = rng.randrange(size), rng.randrange(1, 6), rng.randrange(1, 12)
    got = contiguous_slots(np.array(free), head, n, count).tolist()
    assert got == ref_slots(free, head, n, count)


@pytest.mark.parametrize("seed", range(100))
def test_first_free_is_kvcells_find_slot(seed: int) -> None:
    rng = random.Random(seed)
    c = KVCells(rng.randrange(1, 80))
    c.pos[:] = [rng.choice([-1, 5]) for _ in range(c.size)]
    free = c.pos == -1
    c.head = rng.randrange(c.size)
    m = rng.randrange(1, int(free.sum()) + 1) if free.any() else 0
    if not m:
        return
    head = 0 if c.head > c.n_used() + 2 * m else c.head  # find_slot's own reset
    assert first_free(free, head, m).tolist() == c.find_slot(m).tolist()


def test_free_runs() -> None:
    s, e = free_runs(np.array([1, 1, 0, 1, 0, 0, 1], dtype=bool))
    assert s.tolist() == [0, 3, 6] and e.tolist() == [2, 4, 7]
    s, e = free_runs(np.zeros(3, dtype=bool))
    assert s.tolist() == [] and e.tolist() == []


@pytest.mark.parametrize("seed", range(200))
def test_searches_near_the_head_find_what_the_whole_search_finds(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 5000))
    free = rng.random(size) < rng.choice([0.05, 0.5, 0.95])
    head, n, count = int(rng.integers(size)), int(rng.integers(1, 40)), int(rng.integers(1, 30))
    assert (
        contiguous_slots_near(free, head, n, count).tolist()
        == contiguous_slots(free, head, n, count).tolist()
    )
    m = int(rng.integers(0, free.sum() + 1))
    assert first_free_near(free, head, m).tolist() == first_free(free, head, m).tolist()
