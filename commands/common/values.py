"""Value lists of the benchmark flags (-p 128,256, -npl 1-8*2), parsed as llama-bench does."""

from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+)(?:([+*])(\d+))?)?$")


def parse_int_list(text: str) -> list[int]:
    """llama-bench's value lists: comma-separated items, each `N` or a range `first-last[+step|*step]`
    ("128,256", "1-4" -> 1,2,3,4, "64-512*2" -> 64,128,256,512)."""
    out: list[int] = []
    for item in text.split(","):
        m = _RANGE.match(item.strip())
        if m is None:
            raise ValueError(f"invalid value or range '{item}' in '{text}'")
        first = int(m[1])
        last = int(m[2]) if m[2] else first
        op, step = m[3] or "+", int(m[4]) if m[4] else 1
        i = first
        while i <= last:
            out.append(i)
            nxt = i + step if op == "+" else i * step
            if nxt <= i:
                raise ValueError(f"range '{item}' does not advance")
            i = nxt
    return out
