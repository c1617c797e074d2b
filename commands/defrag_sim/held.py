"""The positions each sequence holds, as sorted disjoint intervals: what a partial removal or
copy (seq_rm/seq_cp with a range) takes, for the replays that count tokens, not cells."""

from __future__ import annotations

INF = 2**31 - 1


def pos_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's convention: a negative bound is open."""
    return (0 if p0 < 0 else p0, INF if p1 < 0 else p1)


class Held:
    """seq -> [[lo, hi), ...] sorted and disjoint."""

    def __init__(self) -> None:
        self.spans: dict[int, list[list[int]]] = {}

    def add(self, seq: int, p: int, n: int) -> None:
        """n positions from p (after the sequence's last one, as decodes place them)."""
        if n <= 0:
            return
        sp = self.spans.setdefault(seq, [])
        if sp and sp[-1][1] == p:
            sp[-1][1] += n
        else:
            sp.append([p, p + n])
            sp.sort()

    def append(self, seq: int, n: int) -> None:
        """n positions after the sequence's last one (0 when it holds none)."""
        sp = self.spans.get(seq)
        self.add(seq, sp[-1][1] if sp else 0, n)

    def count(self, seq: int, lo: int, hi: int) -> int:
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in self.spans.get(seq, ()))

    def total(self, seq: int) -> int:
        return self.count(seq, 0, INF)

    def remove(self, seq: int, lo: int, hi: int) -> int:
        """Removes [lo, hi); returns how many positions that took."""
        n = self.count(seq, lo, hi)
        out = []
        for a, b in self.spans.get(seq, ()):
            if a < lo:
                out.append([a, min(b, lo)])
            if b > hi:
                out.append([max(a, hi), b])
        self.spans[seq] = out
        return n

    def copy(self, src: int, dst: int, lo: int, hi: int) -> int:
        """dst also holds src's positions in [lo, hi) (a whole copy replaces dst's); returns
        how many were copied."""
        part = [[max(a, lo), min(b, hi)] for a, b in self.spans.get(src, ()) if min(b, hi) > max(a, lo)]
        if (lo, hi) == (0, INF):
            self.spans[dst] = part
        else:
            for a, b in part:
                self.remove(dst, a, b)
            self.spans[dst] = sorted(self.spans.get(dst, []) + part)
        return sum(b - a for a, b in part)

    def clear(self, seq: int) -> None:
        self.spans.pop(seq, None)
