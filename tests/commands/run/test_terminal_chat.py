"""A --session chat at a real terminal (a pty), as a llama.cpp user meets it: Ctrl-D says
where the conversation was saved, and a resumed one shows its earlier turns after the banner."""

from __future__ import annotations

import os
import pty
import re
import sys
from pathlib import Path


def terminal_chat(model: Path, cwd: Path, *typed: bytes) -> tuple[int, str]:
    """kvtool run at a terminal in `cwd`; each of `typed` is written at a fresh `> ` prompt.
    Returns the exit status and everything the terminal showed (stdout and stderr)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: kvtool at a terminal
        os.chdir(cwd)
        args = ["-m", "kvtool.commands", "run", "-m", str(model), "-c", "512", "-n", "3", "--temp", "0"]
        os.execv(sys.executable, [sys.executable, *args, "--session", "chat.kvs"])
    out = b""
    for keys in typed:  # at the prompt itself: readline may drop what was typed before it
        seen = out.count(b"\n> ")
        while out.count(b"\n> ") == seen or not out.endswith(b"\n> "):
            out += os.read(fd, 4096)
        os.write(fd, keys)
    try:
        while chunk := os.read(fd, 4096):
            out += chunk
    except OSError:  # the terminal closes with the child
        pass
    _, status = os.waitpid(pid, 0)
    text = out.decode("utf-8", "replace").replace("\r\n", "\n")
    return os.waitstatus_to_exitcode(status), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # no colours


def test_ctrl_d_says_where_the_session_was_saved(tiny_llama_path: Path, tmp_path: Path) -> None:
    rc, text = terminal_chat(tiny_llama_path, tmp_path, b"the cat\n", b"\x04")
    assert rc == 0, text
    assert (tmp_path / "chat.kvs").exists()
    assert text.endswith("(saved to chat.kvs: 1 turn; --session chat.kvs resumes it)\n"), repr(text[-200:])


def test_a_resumed_session_shows_its_turns_after_the_banner(tiny_llama_path: Path, tmp_path: Path) -> None:
    _, first = terminal_chat(tiny_llama_path, tmp_path, b"the cat\n", b"a dog\n", b"\x04")
    replies = re.findall(r"\n> (?:the cat|a dog)\n(.*?)\n3 tokens, ", first, re.DOTALL)
    assert len(replies) == 2, first
    rc, text = terminal_chat(tiny_llama_path, tmp_path, b"\x04")
    assert rc == 0, text
    banner_end = text.index("Ctrl-C stops a reply")
    resumed = text.index("(resumed chat.kvs: 2 turns, ", banner_end)
    assert text.index(f"\n> the cat\n{replies[0]}\n\n> a dog\n{replies[1]}\n", resumed) > resumed
