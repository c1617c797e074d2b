"""State files on disk: atomic writes (a crash mid-save leaves the previous file intact) that
replace only state files (kvtool.atomic_file holds the rules)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from kvtool.atomic_file import FileKind, check_writable, write_file
from kvtool.errors import KvtoolError, StateError

# A state begins with its header's length (u64) and the header, whose first key is the
# `__metadata__` holding "kvtool.checksum" (docs/state-format.md; tensor names sort after it).
STATE_FILE = FileKind("a kvtool state file", rb'.{8}\{"__metadata__":\{"kvtool\.')


def check_state_path(path: str | Path, *, overwrite: bool = False) -> Path:
    """Checks, before the work, that a state can be saved to `path` (see
    kvtool.check_writable); returns the file a save will replace. StateError otherwise."""
    try:
        return check_writable(path, STATE_FILE, overwrite=overwrite)
    except StateError:
        raise
    except KvtoolError as e:
        raise StateError(str(e)) from None


def write_atomic(path: str | Path, data: bytes, *, overwrite: bool = False) -> int:
    """Writes `data` to `path` atomically (readers see the old file or the new one, never a
    mix); returns the bytes written. Replaces only a state file (any file with `overwrite`);
    a symlink is written through; anything else is a StateError and `path` stays as it was."""
    try:
        return write_file(path, data, STATE_FILE, overwrite=overwrite)
    except StateError:
        raise
    except KvtoolError as e:
        raise StateError(str(e)) from None


def read_file(path: str | Path) -> bytes:
    """The bytes of a state file, or a one-line StateError. Only regular files are read: a
    device (/dev/zero) or a pipe would never end, or end anywhere."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, then is refused
    except FileNotFoundError:
        raise StateError(f"no state file {path}") from None
    except OSError as e:
        raise StateError(f"cannot read {path}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise StateError(f"{path} is {what}, not a state file")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise StateError(f"cannot read {path}: {e.strerror}") from None


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """A StateError about a file's contents (truncated, another model's, corrupted) names the
    file, as a model's errors do: a chat reads several (--session, /load)."""
    try:
        yield
    except StateError as e:
        if str(path) in str(e):
            raise
        raise StateError(f"{path}: {e}") from None
