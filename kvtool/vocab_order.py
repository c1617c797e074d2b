"""The order in which llama.cpp iterates its token -> id map (a libstdc++ std::unordered_map).

When a GGUF leaves a special id unset and several token texts could fill it (SmolLM2 has both
`<|endoftext|>` and `<|im_end|>` for eot), llama.cpp takes whichever its hash map yields
first. With GCC's standard library that order is deterministic: it follows from the string
hash (MurmurHash2, 64-bit), the bucket counts the table grows through, and where each node is
linked in on insertion and on rehash. This module replays that to rank candidate tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MUL = 0xC6A4A7935BD1E995
_SEED = 0xC70F6907
# Bucket counts of a std::unordered_map grown one insertion at a time (max load factor 1):
# the first insertion allocates 13, then each rehash takes libstdc++'s next listed prime >= 2x.
_BUCKETS = (
    13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933,
    351061, 712697, 1447153, 2938679, 5967347, 12117689, 24607243,
)  # fmt: skip


def _shift_mix(v: np.ndarray) -> np.ndarray:
    return v ^ (v >> np.uint64(47))


def std_hash(keys: Sequence[bytes]) -> np.ndarray:
    """std::hash<std::string> of each key, as libstdc++ computes it on 64-bit little-endian."""
    mul = np.uint64(_MUL)
    lens = np.fromiter((len(k) for k in keys), np.int64, len(keys))
    words = (lens + 7) // 8
    starts = np.concatenate([[0], np.cumsum(words)[:-1]]).astype(np.int64)
    # every key zero-padded to whole 8-byte words: a padded tail word equals libstdc++'s tail load
    buf = b"".join(k + bytes(-len(k) % 8) for k in keys)
    data = np.frombuffer(buf, "<u8") if buf else np.zeros(1, np.uint64)
    h = np.uint64(_SEED) ^ (lens.astype(np.uint64) * mul)
    full = lens // 8
    for j in range(int(full.max(initial=0))):
        sel = np.nonzero(full > j)[0]
        h[sel] = (h[sel] ^ (_shift_mix(data[starts[sel] + j] * mul) * mul)) * mul
    sel = np.nonzero(lens % 8)[0]
    h[sel] = (h[sel] ^ data[starts[sel] + full[sel]]) * mul
    return _shift_mix(_shift_mix(h) * mul)


def iteration_order(hashes: np.ndarray) -> np.ndarray:
    """Indices of the keys with these hashes, inserted in index order, in iteration order.

    The node list is a chain of per-bucket groups. A node for an empty bucket opens a new group
    at the front of the chain; any other node goes to the front of its bucket's group. A rehash
    walks the chain and re-links every node by that same rule, so each stage is one sort: groups
    by when they were opened (latest first), nodes by when they arrived (latest first).
    """
    n = len(hashes)
    order = np.zeros(0, np.int64)
    for stage, n_buckets in enumerate(_BUCKETS):
        last = stage + 1 == len(_BUCKETS) or n <= n_buckets
        nodes = np.concatenate([order, np.arange(len(order), n if last else n_buckets)])
        bucket = hashes[nodes] % np.uint64(n_buckets)
        buckets, first = np.unique(bucket, return_index=True)
        opened = first[np.searchsorted(buckets, bucket)]  # arrival of the node that opened the group
        # groups re-linked by the rehash come after those opened by later insertions
        group_key = np.where(opened < len(order), -opened, -(n + opened))
        order = nodes[np.lexsort((-np.arange(len(nodes)), group_key))]
        if last:
            break
    return order


def iteration_rank(keys: Sequence[bytes], wanted: set[int]) -> dict[int, int]:
    """Position in iteration order of the keys `wanted` (indices into `keys`, inserted in order)."""
    order = iteration_order(std_hash(keys))
    pos = np.empty(len(order), np.int64)
    pos[order] = np.arange(len(order))
    return {i: int(pos[i]) for i in wanted}


def std_sort(keys: Sequence[int], depth_limit: int | None = None) -> list[int]:
    """Indices 0..n-1 ordered as libstdc++'s std::sort orders them by ascending `keys`.

    std::sort is not stable, and llama.cpp sorts its special tokens by length with it, so the
    order among tokens of equal length (which decides overlapping matches) is whatever this
    introsort yields: median-of-three quicksort down to runs of 16, heapsort past the depth limit,
    then one insertion sort pass. `depth_limit` overrides 2*log2(n) (0 = heapsort, for tests).
    """
    a = list(range(len(keys)))
    k = list(keys)

    def less(i: int, j: int) -> bool:
        return k[a[i]] < k[a[j]]

    def swap(i: int, j: int) -> None:
        a[i], a[j] = a[j], a[i]

    def adjust_heap(first: int, hole: int, length: int, value: int) -> None:
        top, child = hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if k[a[first + child]] < k[a[first + child - 1]]:
                child -= 1
            a[first + hole] = a[first + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            a[first + hole] = a[first + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and k[a[first + parent]] < k[value]:
            a[first + hole] = a[first + parent]
            hole, parent = parent, (parent - 1) // 2
        a[first + hole] = value

    def heap_sort(first: int, last: int) -> None:
        length = last - first
        for parent in range((length - 2) // 2, -1, -1) if length >= 2 else ():
            adjust_heap(first, parent, length, a[first + parent])
        while last - first > 1:
            last -= 1
            value, a[last] = a[last], a[first]
            adjust_heap(first, 0, last - first, value)

    def introsort(first: int, last: int, depth: int) -> None:
        while last - first > 16:
            if depth == 0:
                heap_sort(first, last)
                return
            depth -= 1
            mid, lo, hi = first + (last - first) // 2, first + 1, last - 1
            if less(lo, mid):
                swap(first, mid if less(mid, hi) else hi if less(lo, hi) else lo)
            else:
                swap(first, lo if less(lo, hi) else hi if less(mid, hi) else mid)
            lo, hi = first + 1, last
            while True:  # unguarded partition around a[first]
                while less(lo, first):
                    lo += 1
                hi -= 1
                while less(first, hi):
                    hi -= 1
                if lo >= hi:
                    break
                swap(lo, hi)
                lo += 1
            introsort(lo, last, depth)
            last = lo

    n = len(a)
    if n > 1:
        introsort(0, n, 2 * (n.bit_length() - 1) if depth_limit is None else depth_limit)
        for i in range(1, n):  # the final insertion sort (its guarded and unguarded parts agree)
            value, j = a[i], i
            while j > 0 and k[value] < k[a[j - 1]]:
                a[j] = a[j - 1]
                j -= 1
            a[j] = value
    return a
