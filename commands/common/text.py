"""Text from outside kvtool, in and out: the one place that decodes it and the one place that
shows it.

In: a prompt from argv, stdin or a file may hold bytes that are not UTF-8. llama.cpp's tokenizer
reads each such byte as U+FFFD and goes on; so does kvtool (`user_text`, `read_text`,
`main` reconfigures stdin). Out: a model name, a file name, a conversation name, a message, the
model's output or a template's text may hold `[/x]`, `[link=...]` or `:smile:`, which a rich
console would read as markup or emoji (and crash on an unmatched tag). The verbs print on
`console()`s, which read neither, and label spinners and bars with `plain()`, which rich does
not parse either. Styles are given with `style=`, never as markup tags. Control characters in
such text (an escape sequence in a stored conversation's name would clear the screen or set
the window title) are shown escaped (`printable`); the model's own replies are printed as they
are, as llama.cpp prints them."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import typer

if TYPE_CHECKING:  # rich takes some 70 ms to import: `--help` and `--version` never need it
    from rich.console import Console
    from rich.text import Text


MAX_TEXT = 16 << 20  # bytes of a prompt file or of one line of input (the template's limit)

# C0 but tab and newline, DEL, C1, and the bidirectional overrides that reorder what is shown
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with its control characters written as escapes (\\x1b, \\u202e)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


@functools.cache
def _console_class() -> type[Console]:
    """rich's Console, rendering every string (arguments, table cells) with its control
    characters escaped (made on first use: rich's import is not cheap)."""
    from rich.console import Console

    class _Console(Console):
        def render_str(self, text: str, **kwargs: Any) -> Text:
            return super().render_str(printable(text), **kwargs)

    return _Console


def console(stderr: bool = False, quiet: bool = False, soft_wrap: bool = True) -> Console:
    """A console on which every string prints as it is: no markup, no emoji codes, no highlighting,
    control characters escaped."""
    return _console_class()(
        stderr=stderr, quiet=quiet, soft_wrap=soft_wrap, markup=False, emoji=False, highlight=False
    )


class _LazyConsole:
    """A `console()` made on its first use: a verb's module-level console costs nothing until
    the verb prints (its --help prints with click)."""

    def __init__(self, stderr: bool, quiet: bool) -> None:
        self._args = (stderr, quiet)
        self._made: Console | None = None

    def made(self) -> Console:
        if self._made is None:
            self._made = console(*self._args)
        return self._made

    def __getattr__(self, name: str) -> Any:
        return getattr(self.made(), name)

    def __enter__(self) -> Console:  # rich's Live holds its console's lock with `with console:`
        return self.made().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.made().__exit__(*exc)  # type: ignore[arg-type]


def real_console(c: Console) -> Console:
    """The rich Console itself, for rich's own classes (Progress, Live), which use it as one."""
    return c.made() if isinstance(c, _LazyConsole) else c


def lazy_console(stderr: bool = False, quiet: bool = False) -> Console:
    """`console(stderr, quiet)`, made when first used (for module-level consoles)."""
    return cast("Console", _LazyConsole(stderr, quiet))


def plain(text: object, style: str = "") -> Text:
    """`text` as a rich Text, which no console reads as markup (spinner and table labels)."""
    from rich.text import Text

    return Text(printable(str(text)), style=style)


def user_text(text: str | None) -> str | None:
    """A text flag as the user gave it (the typer callback of -p, -sys, --conversation...): bytes
    of argv that are not UTF-8, which Python keeps as lone surrogates, become U+FFFD, as
    llama.cpp's tokenizer reads them. File paths keep their bytes: they are not text flags."""
    if text is None:
        return None
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def reconfigure_std_streams() -> None:
    """Piped input that is not UTF-8 reads as U+FFFD (chat turns); output never fails on a
    character the terminal's encoding lacks or on a file name's undecodable bytes."""
    import sys

    for stream, errors in ((sys.stdin, "replace"), (sys.stdout, "backslashreplace")):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors=errors)


def open_input(path: Path) -> BinaryIO:
    """`path` opened for reading without waiting for a writer: a FIFO that nobody writes to
    reads as empty instead of blocking the command for ever (a pipe that has a writer, such as
    `<(command)`, reads as usual)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.set_blocking(fd, True)  # reads wait for data again, while a writer is there
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_text(path: Path, flag: str) -> str:
    """A text file (a prompt, questions, a system prompt): bytes that are not UTF-8 read as
    U+FFFD; a file that cannot be read, or holds more than MAX_TEXT bytes (a device such as
    /dev/zero never ends), is a usage error naming the flag and the file. A pipe or a FIFO is
    read as it comes (`-f <(command)`); see `open_input`."""
    try:
        with open_input(path) as f:
            data = f.read(MAX_TEXT + 1)
    except OSError as e:
        raise typer.BadParameter(f"cannot read {path}: {e.strerror or e}", param_hint=flag) from None
    if len(data) > MAX_TEXT:
        raise typer.BadParameter(f"{path} holds more than {MAX_TEXT >> 20} MiB of text", param_hint=flag)
    return data.decode("utf-8", "replace")


_ESCAPES = {
    ord("n"): b"\n",
    ord("r"): b"\r",
    ord("t"): b"\t",
    ord("'"): b"'",
    ord('"'): b'"',
    ord("\\"): b"\\",
}
_HEX = frozenset(b"0123456789abcdefABCDEF")


def process_escapes(text: str) -> str:
    """llama.cpp's string_process_escapes (-e, on by default): \\n \\r \\t \\' \\" \\\\ and \\xHH
    become what they name; any other backslash stays. Works on the UTF-8 bytes, as llama.cpp
    does; a \\xHH that makes invalid UTF-8 reads as U+FFFD."""
    data = text.encode("utf-8", "surrogateescape")
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        c = data[i]
        if c != 0x5C or i + 1 >= n:  # not a backslash, or one at the very end
            out.append(c)
            i += 1
            continue
        e = data[i + 1]
        if e in _ESCAPES:
            out += _ESCAPES[e]
            i += 2
        elif e == ord("x") and i + 3 < n and data[i + 2] in _HEX and data[i + 3] in _HEX:
            out.append(int(data[i + 2 : i + 4], 16))
            i += 4
        else:
            out += data[i : i + 2]
            i += 2
    return out.decode("utf-8", "replace")
