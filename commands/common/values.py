"""The values of numeric flags: range checks (one for every verb's flags) and the value lists of
the benchmark flags (-p 128,256, -npl 1-8*2), parsed as llama-bench does."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import typer

_RANGE = re.compile(r"^(\d{1,19})(?:-(\d{1,19})(?:([+*])(\d{1,19}))?)?$")

INT_MAX = 2**31 - 1  # llama.cpp reads these flags as C ints (std::stoi)
MAX_THREADS = 512  # GGML_MAX_N_THREADS; kvtool.set_n_threads refuses more
MAX_SEQ = 64  # sequences a context holds (kvtool.ContextParams.n_seq_max)
MAX_LIST = 1024  # values one benchmark flag may list: a sweep, not an allocation


def parse_int_list(text: str) -> list[int]:
    """llama-bench's value lists: comma-separated items, each `N` or a range `first-last[+step|*step]`
    ("128,256", "1-4" -> 1,2,3,4, "64-512*2" -> 64,128,256,512). Values are C ints; a range that
    lists nothing (512-128) or more than MAX_LIST values in all is refused before it is built."""
    out: list[int] = []
    for item in text.split(","):
        m = _RANGE.match(item.strip())
        if m is None:
            raise ValueError(f"invalid value or range '{item}' in '{text}'")
        first = int(m[1])
        last = int(m[2]) if m[2] else first
        op, step = m[3] or "+", int(m[4]) if m[4] else 1
        if max(first, last, step) > INT_MAX:
            raise ValueError(f"'{item}': values must be at most {INT_MAX}")
        if last < first:
            raise ValueError(f"range '{item}' lists nothing (its last value is below its first)")
        if (op == "+" and step < 1) or (op == "*" and (step < 2 or first < 1)):
            raise ValueError(f"range '{item}' does not advance")
        if op == "+" and len(out) + (last - first) // step + 1 > MAX_LIST:  # counted before it is built
            raise ValueError(f"'{text}' lists more than {MAX_LIST} values")
        i = first
        while i <= last:  # a product range lists at most 31 values
            out.append(i)
            i = i + step if op == "+" else i * step
        if len(out) > MAX_LIST:
            raise ValueError(f"'{text}' lists more than {MAX_LIST} values")
    return out


def _num(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:g}"


def _describe(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_num(hi)}"
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
