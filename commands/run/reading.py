"""llama-cli's /read and /glob: text files added to the next chat message, each after a
`--- File: NAME ---` line, as llama-cli adds them (tools/cli/cli-context.cpp)."""

from __future__ import annotations

import os
from pathlib import Path

from kvtool.commands.common.text import read_text

# llama-cli's FILE_GLOB_MAX_RESULTS
MAX_GLOBBED = 100


def file_text(name: str) -> str:
    """`--- File: NAME ---` and the file's text (within the bound of every text input); a
    file that cannot be read is a typer.BadParameter whose message names it."""
    return f"--- File: {name} ---\n{read_text(Path(name).expanduser(), '/read')}"


def _class_match(c: str, cls: str) -> bool:
    """common.cpp's glob_class_match: `c` in the class `cls` (the text between `[` and `]`)."""
    negated = cls.startswith("!")
    i = 1 if negated else 0
    if i < len(cls) and cls[i] in "]-":  # a first `]` or `-` is literal
        if c == cls[i]:
            return not negated
        i += 1
    matched = False
    while i < len(cls):
        if i + 2 < len(cls) and cls[i + 1] == "-" and cls[i + 2] != "]":
            if cls[i] <= c <= cls[i + 2]:
                matched = True
                break
            i += 3
        else:
            if cls[i] == c:
                matched = True
                break
            i += 1
    return matched != negated


def _class_end(pattern: str, p: int) -> int:
    """Where the class that opens at `pattern[p] == "["` closes (its `]`), or -1: a first `]`
    or `-` inside is literal."""
    end = p + 1
    if end < len(pattern) and pattern[end] in "]-":
        end += 1
    return pattern.find("]", end)


def glob_match(pattern: str, text: str) -> bool:
    """common.cpp's glob_match: `*` matches within a path component, `**` across them, `?` one
    character but `/`, `[...]` a class (`!` negates); anything else itself. Run as a set of
    pattern positions over the text, not as llama.cpp's recursion: a path of thousands of
    characters (deep folders) neither overflows the stack nor takes exponential time."""

    def closure(states: set[int]) -> set[int]:
        todo = list(states)
        while todo:  # `*` and `**` may match nothing: the position after them is live too
            p = todo.pop()
            nxt = p + 2 if pattern.startswith("**", p) else p + 1 if pattern.startswith("*", p) else -1
            if nxt >= 0 and nxt not in states:
                states.add(nxt)
                todo.append(nxt)
        return states

    states = closure({0})
    for c in text:
        step: set[int] = set()
        for p in states:
            if p == len(pattern):
                continue
            if pattern.startswith("**", p):
                step.add(p)
            elif pattern[p] == "*":
                if c != "/":
                    step.add(p)
            elif pattern[p] == "?":
                if c != "/":
                    step.add(p + 1)
            elif pattern[p] == "[":
                end = _class_end(pattern, p)
                if end >= 0:
                    if _class_match(c, pattern[p + 1 : end]):
                        step.add(end + 1)
                elif c == "[":
                    step.add(p + 1)
            elif pattern[p] == c:
                step.add(p + 1)
        if not step:
            return False
        states = closure(step)
    return len(pattern) in states


def globbed(pattern: str) -> tuple[list[Path], bool]:
    """The regular files under the current folder (or the folder the pattern starts with, `~`
    for home) whose path relative to it matches, as llama-cli walks them; at most MAX_GLOBBED,
    and whether there were more."""
    root = Path.cwd()
    start = next((i for i, ch in enumerate(pattern) if ch in "![*?"), -1)
    if start > 0 and (cut := pattern[:start].rfind("/")) >= 0:
        root = root / Path(pattern[:cut]).expanduser()
        pattern = pattern[cut + 1 :]
    found: list[Path] = []
    for folder, dirs, names in os.walk(root):  # unreadable folders are skipped
        dirs.sort()
        for name in sorted(names):
            path = Path(folder) / name
            if path.is_file() and glob_match(pattern, path.relative_to(root).as_posix()):
                if len(found) == MAX_GLOBBED:
                    return found, True
                found.append(path)
    return found, False


__all__ = ["MAX_GLOBBED", "file_text", "glob_match", "globbed"]
