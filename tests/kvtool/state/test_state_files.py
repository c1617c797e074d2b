"""Atomic state files: a failed save leaves the previous file and no debris."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtool.errors import StateError
from kvtool.state import read_file, write_atomic

STATE = b"\x10" + b"\0" * 7 + b'{"__metadata__":{"kvtool.checksum":"x"}}'  # how a state file begins


def test_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    f = tmp_path / "s.kvs"
    assert write_atomic(f, STATE + b"one") == len(STATE) + 3
    write_atomic(f, STATE + b"second")
    assert f.read_bytes() == STATE + b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["s.kvs"]


def test_a_failed_save_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "s.kvs"
    write_atomic(f, STATE + b"old")

    def broken(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(StateError, match="No space left on device"):  # one line, not a traceback
        write_atomic(f, STATE + b"new" * 1000)
    assert f.read_bytes() == STATE + b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["s.kvs"]


def test_unwritable_and_unreadable_places_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="no directory"):
        write_atomic(tmp_path / "missing" / "s.kvs", b"x")
    with pytest.raises(StateError, match="no state file"):
        read_file(tmp_path / "nope")


def test_new_files_get_the_usual_permissions(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "new.kvs", b"x")
        assert (tmp_path / "new.kvs").stat().st_mode & 0o777 == 0o644
        (tmp_path / "new.kvs").chmod(0o600)
        write_atomic(tmp_path / "new.kvs", b"y", overwrite=True)  # a replaced file keeps its mode
        assert (tmp_path / "new.kvs").stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(umask)
