"""Arguments of the public API, checked where they come in: a wrong type is a TypeError, a
value out of range a KvtoolError (or the caller's subclass), before anything changes."""

from __future__ import annotations

import operator

from kvtool.errors import KvtoolError

POS_END = 2**31 - 1  # llama_pos is an int32: positions are below this (a range's open end)


def as_int(value: object, what: str) -> int:
    """`value` as an int (a Python or numpy integer; not a bool, a float or a string)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


def in_range(value: object, lo: int, hi: int, what: str, error: type[KvtoolError] = KvtoolError) -> int:
    """`value` as an int in [lo, hi]; `error` names it otherwise."""
    v = as_int(value, what)
    if not lo <= v <= hi:
        raise error(f"{what} must be in [{lo}, {hi}], got {v}")
    return v
