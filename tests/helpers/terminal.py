"""kvtool at a real terminal (a pty): what a user at a terminal types and sees."""

from __future__ import annotations

import os
import pty
import re
import sys
from pathlib import Path


def at_terminal(args: list[str], *typed: bytes, cwd: Path | None = None) -> tuple[int, str]:
    """`python -m kvtool.commands ARGS` at a terminal; each of `typed` is written once a fresh
    `> ` prompt waits. Returns the exit status and what the terminal showed (stdout and
    stderr, newlines as \\n, colours removed)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: kvtool at a terminal
        if cwd is not None:
            os.chdir(cwd)
        os.execv(sys.executable, [sys.executable, "-m", "kvtool.commands", *args])
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
    return os.waitstatus_to_exitcode(status), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
