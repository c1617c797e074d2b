"""llama.cpp's spellings on the command line, checked before click parses it.

llama.cpp spells many flags with one dash and several letters (-ngl, -no-cnv, -ctk). click reads
an undeclared one as a cluster of one-letter flags (`-ngl 99` becomes `-n gl`), so its error
would name the wrong flag. Here such a token is refused naming itself, and where llama.cpp has
the flag, saying what kvtool offers instead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtool import KvtoolError
from kvtool.commands.llama_only import BY_VERB, LLAMA_ONLY


def _declared(command: Any) -> tuple[set[str], set[str]]:
    """The option spellings a click command accepts, and those of them that take a value (read
    by duck typing: typer carries its own click, whose classes differ between versions)."""
    names: set[str] = set()
    valued: set[str] = set()
    for p in command.params:
        if getattr(p, "param_type_name", "") == "option":
            spellings = set(p.opts) | set(p.secondary_opts)
            names |= spellings
            if not p.is_flag and not getattr(p, "count", False):
                valued |= spellings
    return names, valued


def _looks_like_value(arg: str) -> bool:
    """-1, -0.5, or a lone dash: values, not flags."""
    return len(arg) < 2 or arg[1].isdigit() or arg[1] == "."


def check_argv(group: Any, argv: Sequence[str]) -> None:
    """Raises KvtoolError for a flag the chosen command does not declare that click would
    misread (one dash, several letters) or that is llama.cpp's (named with kvtool's offer)."""
    args = list(argv)
    i = 0
    while i < len(args) and args[i].startswith("-"):  # kvtool's own options (-h, --version)
        i += 1
    if i >= len(args):
        return
    command, path = group, ["kvtool"]
    while i < len(args) and hasattr(command, "commands"):  # down to the verb (`state load`)
        sub = command.commands.get(args[i])
        if sub is None:
            if args[i].startswith("-"):
                break  # the group's own options
            return  # click names the unknown command
        command, path, i = sub, [*path, args[i]], i + 1
    where = " ".join(path)
    names, valued = _declared(command)
    rest = iter(args[i:])
    for arg in rest:
        if arg == "--":
            return
        if not arg.startswith("-") or _looks_like_value(arg):
            continue
        flag = arg.split("=", 1)[0]
        if flag in names:
            if flag in valued and "=" not in arg:
                next(rest, None)  # its value, which may itself start with a dash
            continue
        offer = BY_VERB.get(where, {}).get(flag) or LLAMA_ONLY.get(flag)
        if offer:
            raise KvtoolError(f"{where} has no {flag} (llama.cpp's): {offer}")
        if not flag.startswith("--") and len(flag) > 2:
            raise KvtoolError(f"{where} has no option {flag} (see '{where} --help')")
