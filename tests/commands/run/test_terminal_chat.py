"""A --session chat at a real terminal (a pty), as a llama.cpp user meets it: Ctrl-D says
where the conversation was saved, and a resumed one shows its earlier turns after the banner."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers.terminal import at_terminal


def terminal_chat(model: Path, cwd: Path, *typed: bytes) -> tuple[int, str]:
    """A --session chat at a terminal in `cwd`, `typed` at its prompts."""
    args = ["run", "-m", str(model), "-c", "512", "-n", "3", "--temp", "0", "--session", "chat.kvs"]
    return at_terminal(args, *typed, cwd=cwd)


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
