"""The one place kvtool writes files: state files, sessions, the model cache, command outputs.

A write is atomic (a temp file beside the target, fsynced, renamed over it): a crash or an
error mid-write leaves the previous file (or none) in place, never a partial one. A write
never replaces what is not a regular file: a symlink is written through to its target (the
link stays), a directory, device, FIFO or socket is refused. An existing file is replaced
only when it is of the writer's own kind (a state file by a state file...), unless the
caller asks to overwrite. `check_writable` runs the same checks before the work starts, so
that a command says in one line that it cannot save before it computes what to save.

A temporary file is locked (flock) while its writer lives: a write that was killed leaves one
behind, and the next write beside the same target removes it (a lock it can take belongs to no
living writer). A writer that names the `FileVersion` it last read or wrote replaces only that
version: a save by another process in between is a `FileChanged`, not overwritten."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvtool.errors import KvtoolError

_HEAD = 256  # bytes of an existing file read to tell its kind
_LEFT = (".tmp", ".probe")  # what a write leaves beside its target when it is killed


class FileChanged(KvtoolError):
    """Another process replaced the file since this writer's version of it: nothing was written."""


class FileVersion:
    """The version of a file one writer last read or wrote (device, inode, size, change time),
    or its absence: a write through it (`write_file(..., version=)`) replaces only that
    version, and becomes the new one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.stamp = _stamp(self.path)

    def changed(self) -> bool:
        """Whether the file is no longer this version (another process saved or removed it)."""
        return _stamp(self.path) != self.stamp


def _stamp(path: Path) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise KvtoolError(f"cannot read {path}: {e.strerror}") from None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class FileKind:
    """What a writer writes. `what` names the kind in messages ("a kvtool state file"); an
    existing file is replaced only when its first bytes match `magic` (a regular expression
    over bytes; None: any regular file). An empty file is always replaced: it holds nothing."""

    what: str
    magic: bytes | None = None
    role: str = ""  # how messages name the output ("the trace /x/t.jsonl"); "": by its path

    def label(self, path: str | Path) -> str:
        return f"{self.role} {path}" if self.role else str(path)

    def matches(self, head: bytes) -> bool:
        return self.magic is None or not head or re.match(self.magic, head, re.DOTALL) is not None


ANY_FILE = FileKind("a file")


def _kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _target(path: Path, label: str) -> Path:
    """Where a write to `path` lands: a symlink's final target, else `path` itself (absolute)."""
    try:
        return path.resolve()  # a dangling link resolves to the file it would create
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise KvtoolError(f"cannot write {label}: {getattr(e, 'strerror', None) or e}") from None


def check_writable(path: str | Path, kind: FileKind = ANY_FILE, *, overwrite: bool = False) -> Path:
    """Checks that a write of `kind` to `path` can succeed, before the work that produces it:
    the folder exists and takes new files, and what is at `path` (through a symlink) is
    nothing, an empty file, or a regular file of `kind` (any regular file with `overwrite`).
    Returns the path the write will replace (a symlink's target); raises a one-line
    KvtoolError otherwise."""
    path = Path(path).expanduser()
    label = kind.label(path)
    target = _target(path, label)
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise KvtoolError(f"cannot write {label}: {e.strerror}") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise KvtoolError(f"{label} is {_kind_of(st.st_mode)}: kvtool writes only regular files")
        if not overwrite and st.st_size:
            try:
                with open(target, "rb") as f:
                    head = f.read(_HEAD)
            except OSError as e:
                raise KvtoolError(f"cannot read {label} to check what it holds: {e.strerror}") from None
            if not kind.matches(head):
                raise KvtoolError(
                    f"{label} exists and is not {kind.what}: not overwriting it "
                    "(remove it or choose another name)"
                )
    folder = target.parent
    if not folder.is_dir():
        raise KvtoolError(f"cannot write {label}: no directory {folder}")
    try:  # the only test that holds for root, read-only mounts and /proc alike
        fd, probe = _temp(target, ".probe")
    except OSError as e:
        raise KvtoolError(f"cannot write {label}: {folder} takes no new files ({e.strerror})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return target


def _temp(target: Path, suffix: str) -> tuple[int, str]:
    """A new file beside `target`, locked for as long as its descriptor stays open; first, what
    killed writes left beside the same target is removed."""
    remove_left_behind(target)
    while True:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            return fd, tmp
        os.close(fd)  # a cleaner took it for a dead writer's between its creation and the lock


def remove_left_behind(target: str | Path) -> list[Path]:
    """Removes the temporary files of writes to `target` that were killed (their lock is free:
    no living writer holds it); returns them."""
    target = Path(target)
    gone: list[Path] = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return gone
    prefix = f".{target.name}."
    for name in names:
        if not (name.startswith(prefix) and name.endswith(_LEFT)):
            continue
        path = target.parent / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a writer is alive
                os.unlink(path)
                gone.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return gone


@contextlib.contextmanager
def atomic_write(
    path: str | Path,
    kind: FileKind = ANY_FILE,
    *,
    overwrite: bool = False,
    version: FileVersion | None = None,
) -> Iterator[BinaryIO]:
    """Yields a binary file beside `path`'s target (see `check_writable`, run first); when the
    block ends without an error it is fsynced, renamed over the target and the directory
    fsynced, so readers see the old file or the new one. An exception inside the block (a
    failed check included) deletes it and leaves `path` as it was. The writer's own failures
    (no space, no permission) are one-line KvtoolErrors. With `version`, the target is replaced
    only if it is still that version (else FileChanged), which then becomes the new file's."""
    target = check_writable(path, kind, overwrite=overwrite)
    shown = kind.label(Path(path).expanduser())
    try:
        fd, tmp = _temp(target, ".tmp")
    except OSError as e:
        raise KvtoolError(f"cannot write {shown}: {e.strerror}") from None
    in_block = False  # an OSError of the caller's block is the caller's to report
    try:
        os.chmod(tmp, _mode(target))  # mkstemp makes 0600: give the file the mode a plain open would
        with os.fdopen(fd, "wb", closefd=False) as f:  # fd (and its lock) stays open past the rename
            in_block = True
            yield f
            in_block = False
            f.flush()
            os.fsync(fd)
        # another process may have put something else there since the check: replace only a file
        with contextlib.suppress(FileNotFoundError):
            mode = os.lstat(target).st_mode
            if not stat.S_ISREG(mode):
                raise KvtoolError(f"{shown} became {_kind_of(mode)} while writing it: not replaced")
        if version is None:
            os.replace(tmp, target)
        else:
            _replace_version(tmp, target, version, shown)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and not in_block:
            raise KvtoolError(f"cannot write {shown}: {e.strerror or e}") from None
        raise
    finally:
        os.close(fd)
    _fsync_dir(target.parent)


def _replace_version(tmp: str, target: Path, version: FileVersion, shown: str) -> None:
    """The rename, if the target is still `version`: checked and done under a lock on the
    folder, which every versioned writer takes, so two of them cannot both pass the check."""
    dfd = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        if _stamp(target) != version.stamp:
            raise FileChanged(f"{shown} was saved by another process since this one read it")
        os.replace(tmp, target)
        version.stamp = _stamp(target)
    finally:
        os.close(dfd)  # and the lock with it


def write_file(
    path: str | Path,
    data: bytes,
    kind: FileKind = ANY_FILE,
    *,
    overwrite: bool = False,
    version: FileVersion | None = None,
) -> int:
    """Writes `data` to `path` atomically (see `atomic_write`); returns the bytes written."""
    with atomic_write(path, kind, overwrite=overwrite, version=version) as f:
        try:
            f.write(data)
        except OSError as e:  # no space left...
            raise KvtoolError(f"cannot write {kind.label(path)}: {e.strerror or e}") from None
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
