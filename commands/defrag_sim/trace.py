"""KV traces: `kvtool parallel --trace FILE` records, defrag-sim replays (format: docs/defrag.md).

A trace is JSON lines. The first line is a header
`{"kvtool_trace": 1, "n_ctx": ..., "n_seq": ..., "n_ubatch": ..., "kv_unified": ...}`; every
other line is one event at a decode step:
`{"step": t, "event": "alloc", "seq": s, "stream": i, "pos": p0, "n_tokens": n}` (the
sequence's tokens placed by step t's decode, in batch order), `{"step": t, "event": "free",
"seq": s, "stream": i}` (seq_rm(s, -1, -1) before step t) or `{"step": t, "event": "copy",
"src": a, "seq": s, "stream": i}` (seq_cp(a, s, -1, -1) before step t). A removal or copy of a
range of positions adds `"p0"` and `"p1"` (seq_rm(s, p0, p1); negative bounds are open), and
a removal from every sequence (seq_rm(-1, ...)) is one `free` per sequence.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO

from kvtool.commands.common.text import open_input
from kvtool.commands.defrag_sim.names import TRACE_KIND
from kvtool.commands.defrag_sim.workload import Copy, Decode, Free, Op, Run, Workload, op_end
from kvtool.common import files

if TYPE_CHECKING:  # the engine's classes load torch: a replay needs none of it
    from kvtool import Batch, Context

VERSION = 1
MAX_LINE = 4096  # bytes of one event or header line (kvtool writes under 200)
MAX_EVENTS = 5_000_000  # lines: a simulation's memory grows with its events


class TraceRecorder:
    """Writes a trace while `kvtool parallel` runs: wrap the context with `wrap` and hand the
    wrapper to the simulation; successful decodes and whole-sequence removals and copies are
    recorded (a failed decode is rolled back by the engine, so it allocated nothing). Used as a
    context manager: the trace replaces `path` atomically when the block ends without an
    error; after an error (or an interrupt) `path` is left as it was."""

    def __init__(self, path: Path, ctx: Context) -> None:
        self._writing = contextlib.ExitStack()
        self._f: BinaryIO = self._writing.enter_context(files.atomic_write(path, TRACE_KIND))
        self._unified = ctx.params.kv_unified
        self._n_seq = ctx.params.n_seq_max
        self.step = 0
        self._write(
            {
                "kvtool_trace": VERSION,
                "n_ctx": ctx.n_ctx,
                "n_seq": ctx.params.n_seq_max,
                "n_ubatch": ctx.n_ubatch,
                "kv_unified": self._unified,
            }
        )

    def _write(self, d: dict[str, Any]) -> None:
        self._f.write((json.dumps(d, separators=(",", ":")) + "\n").encode())

    def _event(self, event: str, seq: int, **extra: int) -> None:
        stream = 0 if self._unified else seq
        self._write({"step": self.step, "event": event, "seq": seq, "stream": stream, **extra})

    def decoded(self, batch: Batch) -> None:
        """Records a successful decode: per sequence, its run of tokens (a token shared by
        several sequences is recorded under its first)."""
        runs: list[list[int]] = []  # [seq, first pos (-1: the memory's next), n_tokens]
        for pos, seqs in zip(batch.pos, batch.seq_ids, strict=True):
            s, p = int(seqs[0]), -1 if pos is None else int(pos)
            if runs and runs[-1][0] == s and (p < 0 or runs[-1][1] + runs[-1][2] == p):
                runs[-1][2] += 1
            else:
                runs.append([s, p, 1])
        for s, p0, n in runs:
            self._event("alloc", s, pos=p0, n_tokens=n)
        self.step += 1

    @staticmethod
    def _range(p0: int, p1: int) -> dict[str, int]:
        """The range's fields, none for the whole sequence."""
        return {} if p0 <= 0 and p1 < 0 else {"p0": max(p0, -1), "p1": max(p1, -1)}

    def removed(self, seq: int, p0: int, p1: int) -> None:
        """seq_rm(seq, p0, p1) succeeded (seq < 0: every sequence)."""
        for s in range(self._n_seq) if seq < 0 else [seq]:
            self._event("free", s, **self._range(p0, p1))

    def copied(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._event("copy", dst, src=src, **self._range(p0, p1))

    def wrap(self, ctx: Context) -> Context:
        """A view of `ctx` whose decode and memory seq_rm/seq_cp are recorded."""
        return _TracedContext(ctx, self)  # type: ignore[return-value]

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._writing.__exit__(kind, error, tb)


class _TracedMemory:
    def __init__(self, memory: Any, rec: TraceRecorder) -> None:
        self._m, self._rec = memory, rec

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        ok = bool(self._m.seq_rm(seq, p0, p1))
        if ok:
            self._rec.removed(seq, p0, p1)
        return ok

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self._m.seq_cp(src, dst, p0, p1)
        self._rec.copied(src, dst, p0, p1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


class _TracedContext:
    def __init__(self, ctx: Context, rec: TraceRecorder) -> None:
        self._ctx, self._rec = ctx, rec
        self.memory = _TracedMemory(ctx.memory, rec)

    def decode(self, batch: Batch) -> None:
        self._ctx.decode(batch)
        self._rec.decoded(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


class TraceError(ValueError):
    """A trace file that cannot be replayed (the message names the line)."""


def read_trace(path: Path) -> tuple[Workload, dict[str, Any]]:
    """The trace's ops (runs of one-token steps merged) and its header. Read a line at a
    time, each bounded (a device, a FIFO or a file that is no trace is refused at its first
    line, not read whole)."""
    try:
        with open_input(path) as f:
            return _read(path, _lines(path, f))
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror}") from None


def _lines(path: Path, f: BinaryIO) -> Iterator[str]:
    for i in itertools.count(1):
        raw = f.readline(MAX_LINE + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE:
            raise TraceError(f"{path}:{i}: a line longer than {MAX_LINE} bytes: not a trace")
        if i > MAX_EVENTS:
            raise TraceError(f"{path}: more than {MAX_EVENTS:,} events: too long to simulate")
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:  # a trace is JSON lines kvtool wrote: not text, not a trace
            raise TraceError(f"{path}:{i}: not a trace: byte {e.start} is not UTF-8") from None


def _read(path: Path, lines: Iterator[str]) -> tuple[Workload, dict[str, Any]]:
    first = next(lines, None)
    if first is None:
        raise TraceError(f"{path} is empty")
    header = _parse(path, 1, first)
    if header.get("kvtool_trace") != VERSION:
        raise TraceError(f"{path}:1: not a kvtool trace (version {VERSION} header expected)")
    for key in ("n_ctx", "n_seq"):
        if not isinstance(header.get(key), int) or header[key] < 1:
            raise TraceError(f"{path}:1: header needs a positive integer '{key}'")
    ops: list[Op] = []
    parts: list[tuple[int, int]] = []
    step = -1
    n_requests = 0
    started: set[int] = set()  # sequences inside a request (allocated since their last free)
    for i, line in enumerate(lines, 2):
        if not line.strip():
            continue
        ev = _parse(path, i, line)
        try:
            t, kind, seq = int(ev["step"]), str(ev["event"]), int(ev["seq"])
            if t < step or not 0 <= seq < header["n_seq"]:
                raise ValueError("steps must not decrease and seq must be below n_seq")
            if t != step and parts:
                ops.append(Decode(step, tuple(parts)))
                parts = []
            step = t
            if kind == "alloc":
                n = int(ev["n_tokens"])
                if n < 1:
                    raise ValueError("n_tokens must be >= 1")
                n_requests += seq not in started
                started.add(seq)
                parts.append((seq, n))
            elif kind == "free":
                free = Free(t, seq, int(ev.get("p0", -1)), int(ev.get("p1", -1)))
                if free.whole:
                    started.discard(seq)
                ops.append(free)
            elif kind == "copy":
                src = int(ev["src"])
                if not 0 <= src < header["n_seq"]:
                    raise ValueError("src must be below n_seq")
                ops.append(Copy(t, src, seq, int(ev.get("p0", -1)), int(ev.get("p1", -1))))
            else:
                raise ValueError(f"unknown event '{kind}'")
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{path}:{i}: bad event ({e})") from None
    if parts:
        ops.append(Decode(step, tuple(parts)))
    merged = merge_runs(ops)
    n_steps = max((op_end(op) for op in merged), default=0)
    return Workload(tuple(merged), n_steps, int(header["n_seq"]), n_requests, f"trace {path.name}"), header


def _parse(path: Path, i: int, line: str) -> dict[str, Any]:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}:{i}: not JSON ({e.msg})") from None
    except RecursionError:  # a line of a few thousand brackets
        raise TraceError(f"{path}:{i}: JSON nested too deeply: not a trace") from None
    if not isinstance(d, dict):
        raise TraceError(f"{path}:{i}: not a JSON object")
    return d


def merge_runs(ops: list[Op]) -> list[Op]:
    """Consecutive one-token-per-sequence decodes of the same sequences become one Run."""
    out: list[Op] = []
    for op in ops:
        seqs = tuple(s for s, _ in op.parts) if isinstance(op, Decode) else ()
        if isinstance(op, Decode) and all(n == 1 for _, n in op.parts) and len(set(seqs)) == len(seqs):
            last = out[-1] if out else None
            if isinstance(last, Run) and last.seqs == seqs and last.t + last.k == op.t:
                out[-1] = Run(last.t, seqs, last.k + 1)
            else:
                out.append(Run(op.t, seqs, 1))
        else:
            out.append(op)
    return out
