"""State files on disk: atomic writes (a crash mid-save leaves the previous file intact)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtool.atomic_file import atomic_write
from kvtool.errors import StateError


def write_atomic(path: str | Path, data: bytes) -> int:
    """Writes `data` to `path` atomically (readers see the old file or the new one, never a
    mix); returns the bytes written."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise StateError(f"cannot save state: no directory {folder}")
    with atomic_write(path) as f:
        f.write(data)
    return len(data)


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
