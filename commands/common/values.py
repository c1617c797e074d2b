"""The values of numeric flags: range checks (one for every verb's flags) and the value lists of
the benchmark flags (-p 128,256, -npl 1-8*2), parsed as llama-bench does."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import typer

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


def _describe(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return "a finite number"


def bounds(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[Any], Any]:
    """The range check of a numeric flag, as its typer callback: a value outside [lo, hi] (or the
    open bounds), NaN or infinite is a usage error naming the flag (one `error:` line, exit 2),
    raised while click parses the line, before any work. None (an unset flag) passes."""
    want = _describe(lo, hi, lo_open, hi_open)

    def check(value: Any) -> Any:
        if value is None:
            return value
        for v in value if isinstance(value, (list, tuple)) else [value]:
            bad = isinstance(v, float) and not math.isfinite(v)
            bad = bad or (lo is not None and (v <= lo if lo_open else v < lo))
            bad = bad or (hi is not None and (v >= hi if hi_open else v > hi))
            if bad:
                raise typer.BadParameter(f"must be {want}, got {v}")
        return value

    return check
