"""The user's turns, as llama-cli reads them: a line that ends in `\\` goes on on the next line
(with -mli, every line goes on, and one that ends in `\\` ends the turn); on a terminal with line
editing and a `> ` prompt, from a pipe line by line until its end."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from kvtool import KvtoolError
from kvtool.commands.common.text import MAX_TEXT


def join_lines(read: Callable[[], str | None], multiline: bool = False) -> str | None:
    """One turn from `read` (a line without its newline, None at the end of input): lines are
    joined with newlines while they continue (llama.cpp's console::readline). None when the
    input ended before a turn began; a turn cut by the end of input is returned as it is."""
    parts: list[str] = []
    size = 0
    while True:
        line = read()
        if line is None:
            return "\n".join(parts) if parts else None
        size += len(line) + 1
        if size > MAX_TEXT:  # continued lines without end (a file of backslashes)
            raise KvtoolError(f"a turn is longer than {MAX_TEXT >> 20} Mi characters")
        more = multiline
        if line.endswith("\\"):  # a trailing backslash flips the default: go on, or stop
            line, more = line[:-1], not multiline
        parts.append(line)
        if not more:
            return "\n".join(parts)


def terminal_turns(multiline: bool, write: Callable[[str], None]) -> Iterator[str]:
    """Turns typed at a terminal: `> ` before each, readline's editing and history. Ctrl-D on
    an empty prompt ends the chat on a fresh line."""
    import readline  # noqa: F401  (line editing and history for input())

    first = [True]

    def read() -> str | None:
        try:
            line = input("\n> " if first[0] else "")
        except EOFError:
            write("\n")  # Ctrl-D leaves the cursor after the prompt: end that line
            return None
        first[0] = False
        return line

    while True:
        first[0] = True
        turn = join_lines(read, multiline)
        if turn is None:
            return
        yield turn


def piped_turns(multiline: bool, echo: Callable[[str], None] | None) -> Iterator[str]:
    """Turns read from a pipe, each shown through `echo` (as `> text`) unless it is None. A
    line is read up to MAX_TEXT characters: a line of /dev/zero never ends."""

    def read_lines() -> Iterator[str]:
        while line := sys.stdin.readline(MAX_TEXT + 1):
            if len(line) > MAX_TEXT:
                raise KvtoolError(f"a line of input is longer than {MAX_TEXT >> 20} Mi characters")
            yield line.rstrip("\n")

    lines = read_lines()

    while True:
        turn = join_lines(lambda: next(lines, None), multiline)
        if turn is None:
            return
        if echo is not None:
            echo(f"\n> {turn}\n")
        yield turn
