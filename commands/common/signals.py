"""The signals that end a verb: SIGINT (Ctrl-C), SIGTERM and SIGHUP (the terminal closed).

SIGTERM and SIGHUP end the verb the way Ctrl-C interrupts it: as an exception in the main
thread (`Terminated`, a KeyboardInterrupt), so a reply in progress stops where it is and is
kept, and the `finally` blocks that save what the user has run before the process exits with
128 + the signal's number. A save runs under `held()`: a signal that arrives meanwhile is
delivered when the save is done, so a save is never cut in the middle. SIGKILL cannot be
caught; what a verb saved as it went (each chat turn) is what survives it.

A verb that stops by itself, as a server does (`redirected`), gets the same three signals as
calls instead, and ends normally."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

ENDING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP asked the process to end."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_held: list[int] | None = None  # signals that came while a save ran
_ending: int | None = None  # the first ending signal received


def _handler(signum: int, frame: FrameType | None) -> None:
    global _ending
    if signum != signal.SIGINT and _ending is None:
        _ending = signum
    if _held is not None:
        _held.append(signum)
        return
    _raise(signum)


def _raise(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


@contextlib.contextmanager
def _handling(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """`handler` for SIGINT, SIGTERM and SIGHUP while the block runs, in the main thread (in
    other threads nothing changes); the handlers before it come back at its end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, *ENDING)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise in the main thread while the block runs (elsewhere,
    and in other threads, nothing changes)."""
    global _ending
    if threading.current_thread() is threading.main_thread():
        _ending = None
    with _handling(_handler):
        yield


@contextlib.contextmanager
def redirected(stop: Callable[[int], None]) -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM and SIGHUP call `stop(signum)` in the main thread
    instead of raising: a verb that shuts down by itself (serve lets requests in flight end)
    and then returns normally. The handlers before it come back at its end."""
    with _handling(lambda signum, _frame: stop(signum)):
        yield


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Signals that arrive while the block runs are delivered once it ends (a save is whole or
    not begun). Nested blocks deliver at the outermost end."""
    global _held
    if _held is not None:
        yield
        return
    _held = []
    try:
        yield
    finally:
        came, _held = _held, None
        if came:  # the ending one first: Ctrl-C during a SIGTERM's save ends too
            _raise(next((s for s in came if s != signal.SIGINT), came[0]))


def ending() -> Terminated | None:
    """The ending signal that came (SIGTERM or SIGHUP), as its exception, or None."""
    return None if _ending is None else Terminated(_ending)


def check() -> None:
    """Raises Terminated if an ending signal came, even where its exception was caught (a
    reply stops on any interrupt and is kept; the verb ends after that)."""
    if _ending is not None:
        raise Terminated(_ending)
