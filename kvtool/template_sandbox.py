"""The sandbox a chat template from a GGUF runs in: jinja2's immutable sandbox (no unsafe
attribute, no mutation) plus bounds on what one render may cost.

A template is code from a stranger's file. The stock sandbox stops it reading Python's internals
but not spending the machine: `'x' * 10**10`, a string doubled in a loop, nested loops over
`range(10**5)`, a macro calling itself twice. Here every render carries a budget (`Limits`):

- time: a deadline, checked at every hook the template's code passes through: attribute and
  item access, calls (macros included), operators, each step of a `for` loop, each output chunk,
  each item a built-in filter or global (`lipsum`, `slice`, `batch`, `map`...) yields;
- size: each string, list or tuple the template builds (operators, `~`, filters, str methods,
  `%` and `str.format`, output values) is checked against `max_chars` *before* it is built when
  its size can be known (`'x' * n`, `center(n)`, `'%*d'`, joins), else right after;
- memory: the process's resident memory may grow by at most `max_growth_bytes` while rendering
  (read with psutil after each large value and every few thousand hooks), which
  bounds the many-medium-values case no single check sees.

Exceeding any bound raises TemplateError with one line."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sized
from contextvars import ContextVar
from dataclasses import dataclass
from functools import wraps
from typing import Any

import jinja2
import psutil
from jinja2.compiler import CodeGenerator, Frame
from jinja2.nodes import Concat, For
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from kvtool.errors import TemplateError
from kvtool.template_sizes import filter_size, operator_size, str_method_size, text_size

# Bounds `a ** b` on ints, whose cost grows with the result's size.
_MAX_POW_BITS = 1 << 16
# Values at least this large are followed by a look at resident memory.
_LARGE = 1 << 16
# Filters that sort their input in one C call; they take at most this many items.
_SORTS = frozenset({"sort", "dictsort", "groupby", "unique"})
_MAX_SORT = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one render may cost: seconds, characters (or items) of any one value, and growth of
    the process's resident memory in bytes. The defaults are far above what a real template
    needs for a conversation that fits any context (microseconds, kilobytes)."""

    time_s: float = 5.0
    max_chars: int = 1 << 24
    max_growth_bytes: int = 1 << 30


def _rss_bytes() -> int:
    """Resident memory of this process (psutil, on every system; 0 where it cannot be read:
    no memory bound then)."""
    try:
        return int(psutil.Process().memory_info().rss)  # this pid, also in a forked child
    except (OSError, RuntimeError, psutil.Error):
        return 0


class Budget:
    """The running cost of one render."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.time_s
        self.rss0 = _rss_bytes()
        self.n = 0

    def tick(self) -> None:
        """A hook passed: past the deadline, or (now and then) over the memory bound?"""
        self.n += 1
        if time.monotonic() > self.deadline:
            raise TemplateError(f"runs longer than its time limit ({self.limits.time_s:g} s)")
        if self.n % 4096 == 0:
            self.check_memory()

    def check_memory(self) -> None:
        if self.rss0 and _rss_bytes() - self.rss0 > self.limits.max_growth_bytes:
            raise TemplateError(f"uses more than {self.limits.max_growth_bytes >> 20} MiB of memory")

    def fits(self, size: int, what: str) -> None:
        """Refuses a value of `size` characters or items (before or after it is built)."""
        if size > self.limits.max_chars:
            raise TemplateError(f"builds a {what} larger than {self.limits.max_chars} characters or items")
        if size >= _LARGE:
            self.check_memory()

    def built(self, value: Any) -> Any:
        """`value`, once checked: a string, list, tuple or dict within max_chars."""
        if isinstance(value, (str, list, tuple, dict)):
            self.fits(len(value), type(value).__name__)
        return value


_budget: ContextVar[Budget | None] = ContextVar("kvtool_template_budget", default=None)
_UNBOUNDED = Limits(time_s=float("inf"))


def _current() -> Budget:
    """The budget of the render under way (compile-time constant folding has none: unbounded)."""
    b = _budget.get()
    return b if b is not None else Budget(_UNBOUNDED)


def render(template: jinja2.Template, limits: Limits, **variables: Any) -> Iterator[str]:
    """The template's output chunks, rendered under `limits` (each chunk costs a tick)."""
    budget = Budget(limits)
    token = _budget.set(budget)
    try:
        for chunk in template.generate(**variables):
            budget.tick()
            yield chunk
    finally:
        _budget.reset(token)


def guard_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` (a filter or a global function) with the budget's checks: a tick, a size check before
    (where the size can be told) and after, and a tick for each item a generator it returns
    yields (`range(10)|slice(2000000000)` ran for a minute inside one call). jinja's
    pass_context & co. markers are kept by `wraps`."""

    @wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        b = _current()
        b.tick()
        plain = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.Environment))]
        plain = [a for a in plain if not isinstance(a, jinja2.nodes.EvalContext)]
        size = filter_size(name, tuple(plain), kwargs, b.limits.max_chars)
        if size is not None:
            b.fits(size, f"'{name}' result")
        if name in _SORTS and plain and isinstance(plain[0], Sized) and len(plain[0]) > _MAX_SORT:
            # one sort runs in C, where no tick can stop it: refused by its size instead
            raise TemplateError(f"sorts {len(plain[0])} items with '{name}' (at most {_MAX_SORT})")
        out = b.built(f(*args, **kwargs))
        return _ticking(out, b) if isinstance(out, Iterator) else out

    return guarded


def _ticking(items: Iterator[Any], b: Budget) -> Iterator[Any]:
    for item in items:
        b.tick()
        yield item


@jinja2.pass_context
def _each_step(_context: jinja2.runtime.Context, iterable: Any) -> Iterator[Any]:
    """A `for` loop's iterable, one tick per step (an empty loop body passes no other hook)."""
    b = _current()
    for item in iterable:
        b.tick()
        yield item


def _pow_too_large(left: Any, right: Any) -> bool:
    """`int ** int` costs with its result's size: refuse results beyond _MAX_POW_BITS bits."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return False
    return right > 0 and abs(left) > 1 and right * abs(left).bit_length() > _MAX_POW_BITS


class _CodeGenerator(CodeGenerator):
    """Compiles `a ~ b` to a checked join (jinja's own would call str() on any value unseen)."""

    def visit_Concat(self, node: Concat, frame: Frame) -> None:
        self.write("environment.kvtool_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that fails loudly on unsafe attributes and runs under a `Budget`."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _CodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._finalize, **options)
        self.filters["kvtool_each_step"] = _each_step

    def guard_filters(self) -> None:
        """Puts every filter and global function (call it once the template's own are added)
        under the budget."""
        for name, f in list(self.filters.items()):
            if name != "kvtool_each_step":
                self.filters[name] = guard_filter(name, f)
        for name, g in list(self.globals.items()):
            if callable(g):
                self.globals[name] = guard_filter(name, g)

    def _parse(self, source: str, name: str | None, filename: str | None) -> jinja2.nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(For):
            loop.iter = jinja2.nodes.Filter(
                loop.iter, "kvtool_each_step", [], [], None, None, lineno=loop.lineno
            )
        return tree

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # The stock sandbox returns an Undefined, so `{{ ''.__class__ }}` would print nothing.
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is not allowed")

    def _finalize(self, value: Any) -> Any:
        b = _current()
        if not isinstance(value, str):
            b.fits(text_size(value, b.limits.max_chars), "printed value")
        return value

    def kvtool_concat(self, parts: tuple[Any, ...]) -> str:
        """`a ~ b ~ ...`: jinja's str_join, with its size checked first."""
        b = _current()
        b.tick()
        b.fits(sum(text_size(p, b.limits.max_chars) for p in parts), "string")
        return "".join(map(str, parts))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _current().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _current().tick()
        return super().getitem(obj, argument)

    def call_unop(self, context: jinja2.runtime.Context, operator: str, arg: Any) -> Any:
        _current().tick()
        return super().call_unop(context, operator, arg)

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        b = _current()
        b.tick()
        if operator == "**" and _pow_too_large(left, right):
            raise SecurityError(f"result of {operator!r} too large")
        size = operator_size(operator, left, right, b.limits.max_chars)
        if size is not None:
            b.fits(size, f"result of {operator!r}")
        return b.built(super().call_binop(context, operator, left, right))

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        b = _current()
        b.tick()
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        size = str_method_size(target, args, kwargs, b.limits.max_chars)
        if size is not None:
            b.fits(size, f"result of str.{getattr(target, '__name__', '?')}")
        return b.built(super().call(__context, __obj, *args, **kwargs))
