"""Special files as every path a command takes (issue 28): each verb's file flags and
arguments, and the chat's /load and /save, given a device that never ends (/dev/zero,
/dev/urandom), one that is always empty or full (/dev/null, /dev/full), FIFOs (fed without end,
fed once, never fed), a socket, a symlink loop, a directory and /proc files. Each case must end
within its time limit with exit 0 or an `error:` line, never a traceback, a hang or a memory
blow-up (the CLI fuzzer's worker runs it, tests/fuzz/test_cli_fuzz.py)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.fuzz.test_cli_fuzz import CliCase, Files, Worker, baseline, option_kind, problem, verbs


class _Feeder:
    """Writes to a FIFO from a thread while a case runs: without end, or `once` then closes."""

    def __init__(self, path: Path, once: bytes | None) -> None:
        self.path, self.once = path, once
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.once is not None:  # waits for a reader (an open for writing fails until one comes)
            while not self.stop.is_set():
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    self.stop.wait(0.01)
                    continue
                with contextlib.suppress(OSError):
                    os.write(fd, self.once)
                os.close(fd)
                return
            return
        fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)  # never waits for a reader
        chunk = b"x" * 4096 + b"\n"
        try:
            while not self.stop.is_set():
                _, ready, _ = select.select([], [fd], [], 0.05)
                if ready:
                    with contextlib.suppress(BlockingIOError, BrokenPipeError):
                        os.write(fd, chunk)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


@dataclass(frozen=True)
class Special:
    name: str
    path: str
    feed: str = ""  # "endless", "once", or "" (a FIFO nobody writes to, or no FIFO)


def make_specials(root: Path) -> list[Special]:
    """The special files, made under `root` (FIFOs, a socket, a loop) or the system's own."""
    for fifo in ("fifo-endless", "fifo-once", "fifo-silent"):
        os.mkfifo(root / fifo)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "socket"))  # left bound: a socket file for the whole run
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")
    (root / "a-folder").mkdir(exist_ok=True)
    return [
        Special("/dev/zero", "/dev/zero"),
        Special("/dev/urandom", "/dev/urandom"),
        Special("/dev/null", "/dev/null"),
        Special("/dev/full", "/dev/full"),
        Special("fifo fed without end", str(root / "fifo-endless"), "endless"),
        Special("fifo fed once", str(root / "fifo-once"), "once"),
        Special("fifo nobody writes", str(root / "fifo-silent")),
        Special("socket", str(root / "socket")),
        Special("symlink loop", str(root / "loop-a")),
        Special("directory", str(root / "a-folder")),
        Special("/proc/self/mem", "/proc/self/mem"),
        Special("/proc/self/status", "/proc/self/status"),
    ]


@contextlib.contextmanager
def fed(special: Special) -> Iterator[None]:
    """The special file's writer while a case runs (a FIFO's), stopped after."""
    if not special.feed:
        yield
        return
    feeder = _Feeder(Path(special.path), b"hello\nworld\n" if special.feed == "once" else None)
    try:
        yield
    finally:
        feeder.close()


@dataclass(frozen=True)
class Slot:
    """One path a command takes: a verb's option (or argument), or a chat command."""

    verb: str
    spelling: str  # the option's spelling; "" for a positional argument; "/load" or "/save"


def slots() -> list[Slot]:
    """Every path-taking option and argument of every verb, and the chat's /load and /save."""
    out = []
    for verb, cmd in sorted(verbs().items()):
        if verb.startswith("models"):
            continue  # names, not paths (a fetch reaches the network)
        for p in cmd.params:
            is_path = option_kind(p) is Path or bool({"-m", "--model"} & set(getattr(p, "opts", ())))
            if not is_path:
                continue
            out.append(Slot(verb, "" if p.param_type_name == "argument" else max(p.opts, key=len)))
    return [*out, Slot("run", "/load"), Slot("run", "/save")]


def case_for(slot: Slot, special: Special, f: Files) -> CliCase:
    """The baseline command of the slot's verb with the special file in the slot."""
    argv = [*slot.verb.split(), *baseline(slot.verb, f)]
    if slot.spelling in ("/load", "/save"):
        argv = ["run", "-m", f.model, "-n", "3", "-c", "128", "--no-progress"]
        return CliCase(argv, f"hello\n{slot.spelling} {special.path}\nagain\n/exit\n")
    if slot.spelling == "":
        head = slot.verb.split()
        return CliCase([*head, special.path], "")
    spellings = {"-m": "--model", "-o": "--output", "-i": "--input", "-f": "--file"}
    drop = {slot.spelling, *(k for k, v in spellings.items() if v == slot.spelling)}
    kept: list[str] = []
    it = iter(argv)
    for a in it:  # the baseline's own value for this option goes
        if a in drop:
            next(it, None)
            continue
        kept.append(a)
    stdin = "hello\n/exit\n" if slot.verb == "run" and "-p" not in kept else ""
    return CliCase([*kept, slot.spelling, special.path], stdin)


def all_cases(f: Files, specials: list[Special]) -> list[tuple[Slot, Special, CliCase]]:
    return [(s, sp, case_for(s, sp, f)) for s in slots() for sp in specials]


def describe(slot: Slot, special: Special) -> str:
    where = slot.spelling or "FILE"
    return f"{slot.verb} {where} {special.name}"


@dataclass(frozen=True)
class Outcome:
    slot: Slot
    special: Special
    case: CliCase
    rc: int | None
    problem: str | None  # what broke the invariant, or None

    @property
    def kind(self) -> str:
        """'failed', 'ran' (exit 0) or 'refused' (an `error:` line)."""
        return "failed" if self.problem is not None else "ran" if self.rc == 0 else "refused"


def sweep(f: Files, worker: Worker, root: Path) -> Iterator[Outcome]:
    """Every case, run in `worker` with its FIFO fed, each within 20 s."""
    for slot, special, case in all_cases(f, make_specials(root)):
        with fed(special):
            res = worker.run(case.argv, case.stdin, timeout=20.0)
        yield Outcome(slot, special, case, res["rc"], problem(res))


__all__: list[Any] = [
    "Outcome",
    "Slot",
    "Special",
    "all_cases",
    "describe",
    "fed",
    "make_specials",
    "slots",
    "sweep",
]
