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


def as_text(value: object, what: str) -> str:
    """`value` as a str that is Unicode text: one holding half of a surrogate pair (a JSON
    `\\udcff`, bytes decoded with surrogateescape) has no UTF-8 and is refused."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise KvtoolError(f"{what} is not Unicode text (half of a surrogate pair at {e.start})") from None
    return value
