"""Sizes of what a chat template is about to build, told before it is built: the result of an
operator, a str method, a filter, a `%` or `str.format` formatting, or str() of any value. Each
is an upper estimate (padding widths included), so kvtool.template_sandbox can refuse a
10-gigabyte string without allocating it."""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Iterator
from typing import Any


def text_size(value: Any, limit: int) -> int:
    """The length of str(value), estimated by walking it (strings count their length, every
    item one), stopping as soon as the count passes `limit`."""
    stack, n = [value], 0
    while stack and n <= limit:
        v = stack.pop()
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            n += 2 + len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            n += 2 + len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            n += 8
    return n


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _widths(numbers: Iterable[str | None], args: Any) -> int:
    """The padding a format asks for: its width and precision numbers, and for `*` or a nested
    field the largest integer among its arguments."""
    ints = [a for a in (args if isinstance(args, (list, tuple)) else [args]) if isinstance(a, int)]
    extra = 0
    for g in numbers:
        if g is None or g == "":
            continue
        extra += int(g) if g.isdigit() else max(ints, default=0)
    return extra


def percent_size(fmt: str, args: Any, limit: int) -> int:
    """Upper estimate of len(fmt % args)."""
    numbers = [g for m in _PERCENT_SPEC.finditer(fmt) for g in m.groups()]
    return len(fmt) + text_size(args, limit) + _widths(numbers, args)


def format_size(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> int:
    """Upper estimate of len(fmt.format(*args, **kwargs))."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # str.format raises on it anyway
    numbers: list[str | None] = []
    for _, _, spec, _ in fields:
        numbers += re.findall(r"\d+", spec or "")
        if spec and "{" in spec:
            numbers.append("*")
    values = [*args, *kwargs.values()]
    return len(fmt) + text_size(values, limit) + _widths(numbers, values)


def operator_size(operator: str, left: Any, right: Any, limit: int) -> int | None:
    """The size of `left <operator> right` when it builds a string, list or tuple (else None)."""
    seq = (str, list, tuple, bytes, bytearray)
    if operator == "+" and isinstance(left, seq) and isinstance(right, seq):
        return len(left) + len(right)
    if operator == "*":
        for items, times in ((left, right), (right, left)):
            if isinstance(items, seq) and isinstance(times, int):
                return len(items) * times
    if operator == "%" and isinstance(left, str):
        return percent_size(left, right, limit)
    return None


def str_method_size(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> int | None:
    """The size of a str method's result when it can exceed its input's by far (else None)."""
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if not isinstance(owner, str):
        return None
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        return max(len(owner), first)
    if name == "expandtabs":
        return len(owner) + owner.count("\t") * (first if isinstance(first, int) else 8)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return replace_size(owner, args[0], args[1])
    if name == "join":
        items = first if isinstance(first, (list, tuple)) else []
        return text_size(items, limit) + len(owner) * len(items)
    if name in ("format", "format_map"):
        if name == "format_map":
            return format_size(owner, (), first if isinstance(first, dict) else {}, limit)
        return format_size(owner, args, kwargs, limit)
    return None


def replace_size(s: str, old: str, new: str) -> int:
    """len(s.replace(old, new)), computed without building it."""
    hits = len(s) + 1 if old == "" else s.count(old)
    return len(s) + hits * (len(new) - len(old))


_LIPSUM_WORD = 20  # characters a lipsum word takes at most, with its space or punctuation


def _arg(rest: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    return rest[i] if len(rest) > i else kwargs.get(name, default)


def filter_size(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], limit: int) -> int | None:
    """The size of a filter's (or a global function's) result when it can outgrow its arguments
    and can be told before it runs (else None: it is checked after)."""
    value = args[0] if args else None
    rest = args[1:]
    if name == "lipsum":  # lipsum(n=5, html=True, min=20, max=100): paragraphs of words
        n, top = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
        if isinstance(n, int) and isinstance(top, int):
            return max(n, 0) * (max(top, 1) + 1) * _LIPSUM_WORD
        return None
    if name == "slice":  # as many lists as slices, whatever the value's length
        slices = _arg(rest, kwargs, 0, "slices", 0)
        return slices if isinstance(slices, int) else None
    if name == "batch" and _arg(rest, kwargs, 1, "fill_with", None) is not None:
        count = _arg(rest, kwargs, 0, "linecount", 0)  # the last batch is filled up to it
        return count if isinstance(count, int) else None
    if name == "center":
        width = rest[0] if rest else kwargs.get("width", 80)
        return text_size(value, limit) + (width if isinstance(width, int) else 0)
    if name == "indent":
        width = rest[0] if rest else kwargs.get("width", 4)
        pad = width if isinstance(width, int) else len(str(width))
        text = str(value) if isinstance(value, str) else ""
        return len(text) + (text.count("\n") + 1) * pad
    if name == "format" and isinstance(value, str):
        return percent_size(value, kwargs or rest, limit)
    if name == "replace" and isinstance(value, str) and len(rest) >= 2:
        return replace_size(value, str(rest[0]), str(rest[1]))
    if name in ("join", "tojson", "pprint", "string", "list", "urlencode", "xmlattr", "items"):
        if isinstance(value, Iterator):
            return None  # a generator: sized after (its items passed the hooks)
        return text_size(value, limit) + text_size(rest, limit)
    return None
