"""Slot searches on a stream's free-cell mask: llama.cpp's contiguous first fit from the head,
and KVCells.find_slot's any-free-cells from the head, both for many successive ubatches at once."""

from __future__ import annotations

import numpy as np


def free_runs(free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends (exclusive) of the runs of True in `free`."""
    edges = np.flatnonzero(free[1:] != free[:-1]) + 1  # where a run starts or ends
    bounds = np.concatenate(([0], edges, [len(free)]))
    first = 0 if len(free) and free[0] else 1  # runs alternate: free ones every other
    return bounds[first:-1:2], bounds[first + 1 :: 2]


def _fill(starts: np.ndarray, ends: np.ndarray, n: int, count: int) -> np.ndarray:
    """Starts of up to `count` slots of n cells packed into the runs, in run order."""
    if count == 1:  # one ubatch (most searches): the first run that holds it
        i = np.flatnonzero(ends - starts >= n)[:1]
        return starts[i]
    cap = (ends - starts) // n
    cum = np.cumsum(cap)
    if len(cum) and cum[-1] > count:
        last = int(np.searchsorted(cum, count))
        cap[last] -= cum[last] - count
        cap[last + 1 :] = 0
        cum = np.cumsum(cap)
    k = int(cum[-1]) if len(cum) else 0
    return np.repeat(starts, cap) + n * (np.arange(k) - np.repeat(cum - cap, cap))


def contiguous_slots(free: np.ndarray, head: int, n: int, count: int) -> np.ndarray:
    """Starts of up to `count` successive slots of n free cells, as `count` first-fit searches
    would place them: from the head to the end (a slot never wraps), then from cell 0; each
    search starts where the previous slot ended. Fewer than `count` when the cells run out."""
    starts, ends = free_runs(free)
    after = ends > head
    s1, e1 = np.maximum(starts[after], head), ends[after]
    out = _fill(s1, e1, n, count)
    if len(out) == count or head == 0:  # head 0: the first search went over every cell
        return out
    # wrapped: from cell 0 on what is left before the head (a run holding the head keeps its
    # part before the head, or all of it when nothing fitted after the head)
    s2, e2 = starts[starts < head], np.minimum(ends[starts < head], head)
    if len(e2) and ends[len(e2) - 1] > head and (ends[len(e2) - 1] - head) < n:
        e2[-1] = ends[len(e2) - 1]
    return np.concatenate((out, _fill(s2, e2, n, count - len(out))))


def first_free(free: np.ndarray, head: int, m: int) -> np.ndarray:
    """The first m free cells from the head, wrapping (KVCells.find_slot without a window);
    the caller knows that m cells are free."""
    a = np.flatnonzero(free[head:]) + head
    if len(a) >= m:
        return a[:m]
    return np.concatenate((a, np.flatnonzero(free[:head])[: m - len(a)]))


def _window(n_want: int) -> int:
    # searched first: most slots lie close to the head; the whole stream only when they do not
    return max(4 * n_want, 1024)


def contiguous_slots_near(free: np.ndarray, head: int, n: int, count: int) -> np.ndarray:
    """`contiguous_slots`, trying the cells just after the head first: slots found there are
    the first ones the whole search would find (a run cut by the window's end only loses
    slots beyond it)."""
    end = head + _window(n * count)
    if end < len(free):
        near = contiguous_slots(free[head:end], 0, n, count)
        if len(near) == count:
            return near + head
    return contiguous_slots(free, head, n, count)


def first_free_near(free: np.ndarray, head: int, m: int) -> np.ndarray:
    """`first_free`, looking at the cells just after the head first."""
    end = head + _window(m)
    if end < len(free):
        a = np.flatnonzero(free[head:end])
        if len(a) >= m:
            return a[:m] + head
    return first_free(free, head, m)
