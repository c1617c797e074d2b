"""Signals at random moments of a chat (issue 28): `kvtool run` with a session file or a store,
fed turns on a pipe, gets SIGINT, SIGTERM, SIGHUP or SIGKILL at a random moment, aimed at the
model's load, a prompt's decode, a reply's generation or a turn's save (a random delay after the
start, or after a turn's echo, its reply's first byte or its save's first write; where it
landed is read afterwards from when the output came). Afterwards:

- every file is the old one or a new whole one: the session loads (or is still absent), the
  store opens and each stored conversation loads, no temporary file is left (but by SIGKILL);
- no turn shown to the user is lost: each reply followed by its timing line (printed after its
  save) is saved as shown, and a reply cut short by SIGINT, SIGTERM or SIGHUP is saved as far as
  it was shown; only SIGKILL may lose the turn it interrupted;
- the process ends as the signal says (130, 128 + the signal, or killed), or after SIGINT goes
  on and ends normally, with no traceback.

`run_case` returns where the signal landed and the problems found (empty: the case passed)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import kvtool

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL)
AIMS = ("load", "prompt", "generation", "save")
# the second turn is long, so that its prompt takes a while to decode
TURNS = ["tell me a story about a cat", "and then?" + " the cat sat on the mat." * 20, "how does it end"]
DONE = "tokens, "  # the line after each reply, printed once the turn is saved
READY = "; chat template: "  # -v's line, printed once the model and the session are loaded


@dataclass(frozen=True)
class Case:
    sig: signal.Signals
    delay: float  # seconds after the aimed-at moment
    store: bool  # a --store conversation, else a --session file
    old: bool  # a conversation saved by an earlier run is there first
    aim: str = "load"  # of AIMS: the delay counts from the start, or from turn `turn`'s
    # echo (prompt), its reply's first byte (generation) or its save's first write (save)
    turn: int = 0


@dataclass
class Outcome:
    phase: str  # startup, load, prompt, generation, save, idle, ended (before the signal)
    problems: list[str]


class _Run:
    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        self.out: list[tuple[float, bytes]] = []
        self.err: list[tuple[float, str]] = []
        self._threads = [
            threading.Thread(target=self._read_out, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read_out(self) -> None:
        assert self.p.stdout is not None
        while chunk := self.p.stdout.read1(1 << 16):  # type: ignore[attr-defined]
            self.out.append((time.monotonic() - self.t0, chunk))

    def _read_err(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.err.append((time.monotonic() - self.t0, line.decode(errors="replace")))

    def finish(self, timeout: float) -> int:
        rc = self.p.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return rc


def _files(folder: Path) -> set[tuple[str, int, int]]:
    """What is in `folder` now (names, sizes, modification times): a save changes it."""
    out = set()
    for p in folder.iterdir():
        try:
            st = p.stat()
        except OSError:  # gone meanwhile (a temporary file renamed)
            continue
        out.add((p.name, st.st_size, st.st_mtime_ns))
    return out


def _aimed(run: _Run, case: Case, folder: Path, limit: float) -> None:
    """Returns at the moment the case aims at plus its delay (or when the process ended, or
    after `limit` seconds: the moment never came)."""
    deadline = time.monotonic() + limit
    turn = f"> {TURNS[case.turn]}\n".encode()
    before: set[tuple[str, int, int]] | None = None
    while case.aim != "load" and time.monotonic() < deadline and run.p.poll() is None:
        text = b"".join(chunk for _, chunk in run.out)
        echo = text.find(turn)
        if echo >= 0 and case.aim == "prompt":
            break
        if echo >= 0 and len(text) > echo + len(turn):  # the reply began
            if case.aim == "generation":
                break
            if before is None:
                before = _files(folder)
            elif _files(folder) != before:
                break
        time.sleep(0.0005)
    time.sleep(case.delay)


def _phase(run: _Run, t_sig: float) -> str:
    """Where the signal landed, from when the output arrived (approximately: a pipe's delay)."""
    ready = next((t for t, line in run.err if READY in line), None)
    if ready is None or t_sig < ready:
        return "load"
    text, stamps = b"", []
    for t, chunk in run.out:
        stamps += [t] * len(chunk)
        text += chunk
    dones = [t for t, line in run.err if DONE in line]
    start = 0
    for k in range(len(TURNS)):
        echo = text.find(f"> {TURNS[k]}\n".encode(), start)
        if echo < 0 or stamps[echo] > t_sig:
            return "idle"
        first = echo + len(TURNS[k]) + 3  # the reply's first byte
        if first >= len(text) or stamps[first] > t_sig:
            return "prompt"
        done = dones[k] if k < len(dones) else None
        end = text.find(b"\n> ", first)
        end = end if end > 0 else len(text)
        while end > first and text[end - 1 : end] == b"\n" and stamps[end - 1] > t_sig:
            end -= 1  # the line the chat ends with once a signal stopped it: not the reply's
        last = stamps[end - 1]
        if done is None or t_sig < done:
            return "generation" if t_sig <= last else "save"
        start = end
    return "ended"


def _shown(out: bytes) -> list[tuple[str, str]]:
    """(turn, reply) as shown on stdout, each reply after its '> turn' line (the last maybe
    cut; a turn dropped while its prompt was decoded has none)."""
    text = out.decode(errors="replace")
    marks = []  # where each turn's echo is (a reply may hold "\n> " itself)
    at = 0
    for turn in TURNS:
        i = text.find(f"\n> {turn}\n", at)
        if i < 0:
            break
        marks.append((i, turn))
        at = i + len(turn) + 4
    pairs = []
    for k, (i, turn) in enumerate(marks):
        end = marks[k + 1][0] if k + 1 < len(marks) else len(text)
        reply = text[i + len(turn) + 4 : end]
        pairs.append((turn, reply[:-1] if reply.endswith("\n") else reply))
    return pairs


def _matches(saved: list[tuple[str, str]], shown: list[tuple[str, str]], n_done: int, killed: bool) -> bool:
    """Whether the saved turns are the shown ones: every shown reply is saved as shown, in
    order; a turn shown without a reply may be missing (dropped at its prompt); under SIGKILL
    the turns after the n_done completed ones may be missing, or saved whole. Newlines at a
    reply's end are not compared (the chat ends its last line with some of its own)."""
    saved = [(t, r.rstrip("\n")) for t, r in saved]
    shown = [(t, r.rstrip("\n")) for t, r in shown]
    i = 0
    for k, (turn, reply) in enumerate(shown):
        if i < len(saved) and saved[i] == (turn, reply):
            i += 1
        elif killed and k >= n_done and i < len(saved) and saved[i][0] == turn:
            i += 1  # saved whole before the kill, shown in part
        elif reply and not (killed and k >= n_done):
            return False
    return i == len(saved)


def _saved(case: Case, where: Path) -> tuple[list[dict[str, str]] | None, list[str]]:
    """The saved conversation's messages (None: nothing saved), and problems reading it."""
    if case.store:
        if not where.exists():
            return None, []
        try:
            db = sqlite3.connect(f"{where.resolve().as_uri()}?mode=ro", uri=True)
            rows = db.execute("SELECT name, state, messages FROM conversations").fetchall()
            db.close()
        except sqlite3.DatabaseError as e:
            return None, [f"the store does not open: {e}"]
        problems, found = [], None
        for name, state, messages in rows:
            try:
                kvtool.inspect_state(bytes(state))
            except kvtool.KvtoolError as e:
                problems.append(f"stored '{name}' does not load: {e}")
            if name == "default":
                found = json.loads(messages)
        return found, problems
    if not where.exists():
        return None, []
    try:
        info = kvtool.inspect_state(where)
    except kvtool.KvtoolError as e:
        return None, [f"the session does not load: {e}"]
    return list((info.app or {}).get("chat", {}).get("messages", [])), []


def run_case(model: Path, folder: Path, case: Case, old_messages: list[dict[str, str]] | None) -> Outcome:
    """One case in `folder` (where an earlier run's conversation is, if `case.old`)."""
    where = folder / ("chats.db" if case.store else "chat.kvs")
    keep = ["--store", str(where)] if case.store else ["--session", str(where)]
    cmd = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(model), *keep]
    cmd += ["-n", "200", "--ignore-eos", "-c", "8192", "--temp", "0", "-v"]
    env = {**os.environ, "XDG_STATE_HOME": str(folder / "state")}
    run = _Run(cmd, env)
    assert run.p.stdin is not None
    run.p.stdin.write("".join(t + "\n" for t in TURNS).encode())
    run.p.stdin.flush()
    _aimed(run, case, folder, limit=60.0)
    t_sig = time.monotonic() - run.t0
    alive = run.p.poll() is None
    if alive:
        run.p.send_signal(case.sig)
    time.sleep(0.3)
    run.p.stdin.close()  # after SIGINT the chat reads on and ends
    try:
        rc = run.finish(timeout=120)
    except subprocess.TimeoutExpired:
        run.p.kill()
        return Outcome("hang", ["no end within 120 s of the signal"])
    phase = _phase(run, t_sig) if alive else "ended"
    problems: list[str] = []
    err = "".join(line for _, line in run.err)
    caught = case.sig != signal.SIGKILL  # SIGKILL's exit is the same before and after the handlers
    if (
        phase == "load"
        and caught
        and (rc == -case.sig or (rc == 1 and err.rstrip().endswith("KeyboardInterrupt")))
    ):
        # before the CLI's handlers exist (Python's own imports, a fraction of a second): the
        # signal's default action, with nothing opened or written yet
        phase = "startup"
    elif "Traceback" in err:
        problems.append(f"traceback: {err.strip().splitlines()[-1][:200]}")
    want = {
        signal.SIGINT: (0, 130),
        signal.SIGTERM: (128 + signal.SIGTERM,),
        signal.SIGHUP: (128 + signal.SIGHUP,),
        signal.SIGKILL: (-signal.SIGKILL,),
    }[case.sig]
    if alive and rc not in want and phase != "startup":
        problems.append(f"exit status {rc}, not {want}")
    saved, unreadable = _saved(case, where)
    problems += unreadable
    left = [p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".probe"))]
    if left and case.sig != signal.SIGKILL:
        problems.append(f"temporary files left: {left}")
    shown = _shown(b"".join(chunk for _, chunk in run.out))
    n_done = sum(DONE in line for _, line in run.err)
    msgs = saved or []
    pairs = [(u["content"], a["content"]) for u, a in zip(msgs[::2], msgs[1::2], strict=False)]
    n_old = len(old_messages or []) // 2 if case.old else 0
    old = [
        (u["content"], a["content"])
        for u, a in zip((old_messages or [])[::2], (old_messages or [])[1::2], strict=False)
    ]
    if pairs[:n_old] != old[:n_old] and not unreadable:
        problems.append("the earlier conversation is gone or changed")
    elif not _matches(pairs[n_old:], shown, n_done, case.sig == signal.SIGKILL):
        problems.append(
            f"the saved turns are not the ones shown: saved {pairs[n_old:]!r:.300}, shown {shown!r:.300}"
        )
    return Outcome(phase, problems)


def earlier_conversation(model: Path, folder: Path, store: bool) -> list[dict[str, str]]:
    """A conversation an earlier run saved in `folder` (a session file or the store's default)."""
    keep = ["--store", str(folder / "chats.db")] if store else ["--session", str(folder / "chat.kvs")]
    cmd = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(model), *keep, "-n", "5", "--temp", "0"]
    r = subprocess.run(cmd, input=b"an earlier turn\n", capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    if store:
        db = sqlite3.connect(folder / "chats.db")
        (messages,) = db.execute("SELECT messages FROM conversations WHERE name = 'default'").fetchone()
        db.close()
        return list(json.loads(messages))
    return list((kvtool.inspect_state(folder / "chat.kvs").app or {})["chat"]["messages"])
