"""`state save -o` and `state list --store` on paths that hold something else (issue 14,
defects 1, 8 and 10): refused in one line before any work, the thing there left untouched."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtool
import kvtool.commands.run  # registers the verbs
import kvtool.commands.state
from kvtool.commands import app
from kvtool.common import registry
from kvtool.common.store import ConversationStore

runner = CliRunner()


def no_model(name: str, **_: object) -> Path:
    raise AssertionError("the model was loaded before the output path was checked")


def refused(args: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the verb in process with model loading forbidden; returns its one-line error."""
    monkeypatch.setattr(registry, "resolve_model", no_model)
    r = runner.invoke(app, args)
    assert isinstance(r.exception, kvtool.KvtoolError), r.exception
    return str(r.exception)


def fifo(p: Path) -> None:
    os.mkfifo(p)


def device(p: Path) -> None:
    try:
        os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 7))  # what /dev/full is
    except PermissionError:
        pytest.skip("cannot make a device node here")


def text(p: Path) -> None:
    p.write_text("my notes\n")


def folder(p: Path) -> None:
    p.mkdir()


@pytest.mark.parametrize(
    ("make", "msg"),
    [
        (fifo, "is a FIFO"),
        (device, "is a device"),
        (text, "exists and is not a kvtool state file: not overwriting it"),
        (folder, "is a directory"),
    ],
)
def test_save_refuses_what_is_not_a_state_file_before_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make, msg: str
) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    make(out)
    before = os.lstat(out)
    link = tmp_path / "link"
    link.symlink_to(out)
    for target in (out, link):  # through a symlink too
        assert msg in refused(["state", "save", "-p", "hello", "-o", str(target)], monkeypatch)
    after = os.lstat(out)
    assert (after.st_mode, after.st_ino, after.st_size) == (before.st_mode, before.st_ino, before.st_size)
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "out"]


@pytest.mark.parametrize("where", ["missing/s.kvs", "/proc/kvtool-test.kvs"])
def test_save_where_nothing_can_be_written_says_so_before_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    out = where if where.startswith("/") else str(tmp_path / where)
    msg = refused(["state", "save", "-p", "hello", "-o", out], monkeypatch)
    assert msg.startswith("cannot write") and ("no directory" in msg or "takes no new files" in msg)


def test_save_through_a_symlink_writes_its_target(tiny_llama_path: Path, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    link = tmp_path / "s.kvs"
    link.symlink_to(tmp_path / "real" / "s.kvs")
    for _ in range(2):  # a new target, then a state file replaced through the link
        r = runner.invoke(app, ["state", "save", "-m", str(tiny_llama_path), "-p", "hi", "-o", str(link)])
        assert r.exit_code == 0, r.output
    assert link.is_symlink()
    assert kvtool.inspect_state(tmp_path / "real" / "s.kvs").kind == "context"


def test_the_device_case_is_one_line_from_the_cli(tmp_path: Path) -> None:
    link = tmp_path / "full"
    link.symlink_to("/dev/null")  # a device reached through a link: nothing is replaced
    cmd = [sys.executable, "-m", "kvtool.commands", "state", "save", "-p", "x", "-o", str(link)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: {link} is a device: kvtool writes only regular files"
    assert link.is_symlink() and os.readlink(link) == "/dev/null"


def test_list_refuses_another_programs_database_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "app.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE contacts (name TEXT)")
    con.commit()
    con.close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    assert "not a kvtool store" in refused(["state", "list", "--store", str(db)], monkeypatch)
    assert "not a kvtool store" in refused(["run", "--store", str(db)], monkeypatch)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


def test_list_shows_damaged_rows_and_the_others(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    with ConversationStore(db) as s:
        s.save("fine", b"state", [1, 2, 3], [], "tiny", "fp")
    con = sqlite3.connect(db)
    con.execute("INSERT INTO conversations VALUES ('odd', 'm', 'f', '[]', '[]', 'n', -2, 'x', 'later', 1)")
    con.commit()
    con.close()
    r = runner.invoke(app, ["state", "list", "--store", str(db)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert any("fine" in ln and "3" in ln for ln in lines)
    assert any("odd" in ln and "damaged" in ln for ln in lines)
