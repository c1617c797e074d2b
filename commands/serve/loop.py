"""The engine's own thread, and the bridge that hands its events to the HTTP side's event loop.
The scheduler steps on this thread only; the HTTP side never waits on it: it submits tasks,
cancels them, and reads their events from an asyncio queue."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TypeVar

from kvtool.common.scheduler import Scheduler
from kvtool.common.task import Task, TokenOut

T = TypeVar("T")


class EngineLoop:
    """Steps the scheduler while there is work and sleeps on its wake event otherwise. `call`
    runs a function between two steps (consistent snapshots for /slots and /metrics)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self._calls: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvtool-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends every task (cancelled), then the thread."""
        self._stop = True
        self.sched.wake.set()
        self._thread.join()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._calls.append((fn, fut))  # type: ignore[arg-type]
        self.sched.wake.set()
        return fut

    def _run(self) -> None:
        sched = self.sched
        while not self._stop:
            while self._calls:
                fn, fut = self._calls.popleft()
                try:
                    fut.set_result(fn())
                except Exception as e:  # the caller gets it
                    fut.set_exception(e)
            try:
                busy = sched.step()
            except Exception as e:  # a bug: the tasks in flight fail, the server keeps serving
                print(f"error: the engine step failed: {type(e).__name__}: {e}", file=sys.stderr)
                sched.fail_all(f"internal error: {type(e).__name__}")
                busy = False
            if not busy:
                sched.wake.wait(0.5)
        sched.fail_all("the server is shutting down", stop="cancelled")
        while self._calls:
            self._calls.popleft()[1].cancel()


class TaskStream:
    """TaskEvents that forward a task's tokens to an asyncio queue (None: the task ended)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[TokenOut | None] = asyncio.Queue()

    def on_start(self, task: Task) -> None:
        return None

    def on_token(self, task: Task, out: TokenOut) -> None:
        self._put(out)

    def on_done(self, task: Task) -> None:
        self._put(None)

    def _put(self, item: TokenOut | None) -> None:
        # RuntimeError: the HTTP side's loop has closed (shutdown), nobody reads this task any more
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def tokens(self, task: Task) -> AsyncIterator[TokenOut]:
        """The task's tokens as they come; raises TaskFailed if it ended in an error."""
        while (out := await self.queue.get()) is not None:
            yield out
        if task.stop == "error":
            raise TaskFailed(task.error)


class TaskFailed(Exception):
    """The engine could not serve the task (its message says why)."""
