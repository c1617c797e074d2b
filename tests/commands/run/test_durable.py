"""No turn the user saw is lost, whatever ends the chat (issue 28, items 1-3): SIGTERM and
SIGHUP (a closed terminal) end it like Ctrl-C, after saving, with 128 + the signal; each turn is
saved as it completes, so even SIGKILL keeps what was shown before it; two chats on one session
file keep both; a save that fails says where the conversation went instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvtool
from kvtool.common.store import ConversationStore

DONE = "tokens, "  # the line after each reply (and after its save)
READY = "no chat template"  # the tiny model's note, after the session was read


class Chat:
    """`kvtool run` as a child process, fed turns on a pipe, its stderr followed line by line."""

    def __init__(self, model: Path, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "kvtool.commands", "run", "-m", str(model), "-c", "4096"]
        self.p = subprocess.Popen(
            [*cmd, "--temp", "0", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        self.err: list[str] = []
        self.out = b""
        threading.Thread(target=self._follow, daemon=True).start()
        threading.Thread(target=self._read_out, daemon=True).start()

    def _follow(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.err.append(line.decode(errors="replace"))

    def _read_out(self) -> None:
        assert self.p.stdout is not None
        while chunk := self.p.stdout.read1(1 << 16):  # type: ignore[attr-defined]
            self.out += chunk

    def say(self, text: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(text.encode() + b"\n")
        self.p.stdin.flush()

    def wait_for(self, what: str, count: int = 1, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while sum(what in line for line in self.err) < count:
            assert time.monotonic() < end and self.p.poll() is None, "".join(self.err)
            time.sleep(0.02)

    def wait_output(self, n_bytes: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while len(self.out) < n_bytes:
            assert time.monotonic() < end and self.p.poll() is None, "".join(self.err)
            time.sleep(0.02)

    def end(self, timeout: float = 120) -> int:
        if self.p.stdin is not None and not self.p.stdin.closed:
            self.p.stdin.close()
        return self.p.wait(timeout=timeout)


def messages(path: Path) -> list[dict[str, str]]:
    return (kvtool.inspect_state(path).app or {})["chat"]["messages"]


def replies_shown(out: bytes) -> list[str]:
    """The replies as the user saw them on stdout (each after its '> turn' line)."""
    text = out.decode(errors="replace")
    return [part.split("\n", 1)[1].rstrip("\n") if "\n" in part else "" for part in text.split("\n> ")[1:]]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_an_ending_signal_mid_reply_keeps_every_turn_shown(
    tiny_llama_path: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    session = tmp_path / "chat.kvs"
    chat = Chat(tiny_llama_path, "--session", str(session), "-n", "1000", "--ignore-eos")
    chat.say("first turn")
    chat.say("second turn")
    chat.wait_for(DONE)  # the first reply is done: the second one is being written
    shown = len(chat.out)
    chat.wait_output(shown + 200)
    chat.p.send_signal(sig)
    assert chat.end() == 128 + sig
    saved = messages(session)
    assert [m["role"] for m in saved] == ["user", "assistant", "user", "assistant"]
    assert saved[2]["content"] == "second turn"
    # the reply cut short is kept as far as it was shown (and no further)
    assert len(saved[3]["content"]) > 0 and chat.out.decode(errors="replace").count(saved[3]["content"]) == 1
    assert f"(ended by {sig.name})" in "".join(chat.err)


def test_sigkill_keeps_the_turns_saved_before_it(tiny_llama_path: Path, tmp_path: Path) -> None:
    """Before, turns were written at exit only: SIGKILL (or a crash) lost every one."""
    session = tmp_path / "chat.kvs"
    chat = Chat(tiny_llama_path, "--session", str(session), "-n", "1000", "--ignore-eos")
    chat.say("first turn")
    chat.say("second turn")
    chat.wait_for(DONE)
    chat.wait_output(len(chat.out) + 100)
    chat.p.send_signal(signal.SIGKILL)
    assert chat.end() == -signal.SIGKILL
    saved = messages(session)
    assert [m["content"] for m in saved[::2]] == ["first turn"] and len(saved) == 2
    assert saved[1]["content"] in chat.out.decode(errors="replace")


def test_sigterm_at_the_prompt_keeps_a_store_conversation(tiny_llama_path: Path, tmp_path: Path) -> None:
    db = tmp_path / "chats.db"
    chat = Chat(tiny_llama_path, "--store", str(db), "--conversation-name", "work", "-n", "6")
    chat.say("first turn")
    chat.wait_for(DONE)
    chat.p.send_signal(signal.SIGTERM)  # waiting for the next turn
    assert chat.end() == 128 + signal.SIGTERM
    with ConversationStore(db) as store:
        assert [m["content"] for m in store.messages("work") or []][:1] == ["first turn"]


def test_two_chats_on_one_session_file_keep_both(tiny_llama_path: Path, tmp_path: Path) -> None:
    """The last to exit overwrote the other's turns: now the second to save keeps its
    conversation beside the first (chat~2.kvs) and says so."""
    session = tmp_path / "chat.kvs"
    a = Chat(tiny_llama_path, "--session", str(session), "-n", "4")
    b = Chat(tiny_llama_path, "--session", str(session), "-n", "4")
    a.wait_for(READY)  # both have read the session (there is none yet)
    b.wait_for(READY)
    a.say("from a")
    a.wait_for(DONE)
    b.say("from b")
    b.wait_for(DONE)
    a.say("a again")
    a.wait_for(DONE, 2)
    assert a.end() == 0 and b.end() == 0
    fork = tmp_path / "chat~2.kvs"
    assert [m["content"] for m in messages(session)[::2]] == ["from a", "a again"]
    assert [m["content"] for m in messages(fork)[::2]] == ["from b"]
    assert f"this conversation is kept as {fork}" in "".join(b.err)


def test_session_and_store_together_are_refused(tiny_llama_path: Path, tmp_path: Path) -> None:
    """--session with --store never wrote the session file; now it is a flag error, at once."""
    r = subprocess.run(
        [
            *(sys.executable, "-m", "kvtool.commands", "run", "-m", str(tmp_path / "none.gguf")),
            *("--session", str(tmp_path / "s.kvs"), "--store", str(tmp_path / "s.db")),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "--session" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "s.db").exists()


def test_a_save_that_fails_says_where_the_conversation_went(tiny_llama_path: Path, tmp_path: Path) -> None:
    """The folder of the session is gone by the time the turn is saved (a full disk, a lost
    mount): the error line names the rescued file, which resumes the conversation."""
    folder = tmp_path / "gone"
    folder.mkdir()
    state_home = tmp_path / "state"
    chat = Chat(
        tiny_llama_path,
        "--session",
        str(folder / "chat.kvs"),
        "-n",
        "4",
        env={"XDG_STATE_HOME": str(state_home)},
    )
    chat.wait_for(READY)
    folder.rmdir()
    chat.say("first turn")
    chat.say("second turn")
    assert chat.end() == 2
    errors = [line for line in chat.err if line.startswith("error: ")]
    assert len(errors) == 1, chat.err  # said once, though both turns failed to save
    rescued = list((state_home / "kvtool" / "rescued").glob("*.kvs"))
    assert len(rescued) == 1 and str(rescued[0]) in errors[0] and "--session" in errors[0], errors
    assert [m["content"] for m in messages(rescued[0])[::2]] == ["first turn", "second turn"]
