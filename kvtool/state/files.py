"""State files on disk: atomic writes (a crash mid-save leaves the previous file intact)."""

from __future__ import annotations

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
    """The bytes of a state file, or a one-line StateError."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise StateError(f"no state file {path}") from None
    except IsADirectoryError:
        raise StateError(f"{path} is a directory, not a state file") from None
    except OSError as e:
        raise StateError(f"cannot read {path}: {e.strerror}") from None
