"""State files on disk: atomic writes (a crash mid-save leaves the previous file intact)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from kvtool.errors import StateError


def write_atomic(path: str | Path, data: bytes) -> int:
    """Writes `data` to a temporary file beside `path`, fsyncs it, renames it over `path` and
    fsyncs the directory. Readers see the old file or the new one, never a mix."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise StateError(f"cannot save state: no directory {folder}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        os.chmod(tmp, _mode(path))  # mkstemp makes 0600: give the file the mode a plain open would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)
    return len(data)


def _mode(path: Path) -> int:
    """The replaced file's permissions, or those the umask gives a new file."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(folder: Path) -> None:
    """Makes the rename durable (not possible on every platform)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_file(path: str | Path) -> bytes:
    """The bytes of a state file, or a one-line StateError."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise StateError(f"no state file {path}") from None
    except IsADirectoryError:
        raise StateError(f"{path} is a directory, not a state file") from None
    except OSError as e:
        raise StateError(f"cannot read {path}: {e.strerror}") from None
