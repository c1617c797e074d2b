"""The conversation store refuses other programs' files untouched, lists damaged rows instead
of failing, and refuses a save over a row another process saved meanwhile (issue 14, defects
2 and 10)."""

from __future__ import annotations

import hashlib
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool import StateError
from kvtool.common.store import APPLICATION_ID, ConversationConflictError, ConversationStore

MSG = [{"role": "user", "content": "hi"}]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def other_programs_db(path: Path) -> Path:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, amount REAL)")
    con.execute("INSERT INTO invoices VALUES (1, 99.5)")
    con.commit()
    con.close()
    return path


def test_another_programs_database_is_refused_byte_identical(tmp_path: Path) -> None:
    db = other_programs_db(tmp_path / "app.db")
    before = digest(db)
    with pytest.raises(
        StateError, match=r"another program's SQLite database \(invoices\), not a kvtool store"
    ):
        ConversationStore(db)
    assert digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]  # no -wal, no -shm
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    assert [r[0] for r in con.execute("SELECT name FROM sqlite_master")] == ["invoices"]
    con.close()


def test_another_application_id_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "app.db"
    con = sqlite3.connect(db)
    con.execute("PRAGMA application_id = 1234")
    con.commit()
    con.close()
    before = digest(db)
    with pytest.raises(StateError, match="application_id 0x4d2"):
        ConversationStore(db)
    assert digest(db) == before


def test_empty_files_become_stores_and_stores_are_marked(tmp_path: Path) -> None:
    (tmp_path / "empty.db").touch()
    with ConversationStore(tmp_path / "empty.db") as s:
        s.save("a", b"x", [1], MSG, "m", "f")
    con = sqlite3.connect(tmp_path / "empty.db")
    assert con.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
    con.close()
    with ConversationStore(tmp_path / "empty.db") as s:
        assert s.load("a") == b"x"


def test_a_version_1_store_is_upgraded_with_its_rows(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    con = sqlite3.connect(db)
    con.executescript(
        """
        CREATE TABLE kvtool_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        INSERT INTO kvtool_meta VALUES ('schema', '1');
        CREATE TABLE conversations (name TEXT PRIMARY KEY, model TEXT NOT NULL,
            fingerprint TEXT NOT NULL, tokens TEXT NOT NULL, messages TEXT NOT NULL,
            n_tokens INTEGER NOT NULL, n_messages INTEGER NOT NULL, state BLOB NOT NULL,
            updated REAL NOT NULL);
        INSERT INTO conversations VALUES ('old', 'm', 'f', '[1]', '[]', 1, 0, x'00', 1.0);
        """
    )
    con.close()
    with ConversationStore(db) as s:
        assert s.load_generation("old") == (b"\x00", 1)
        assert s.save("old", b"\x01", [1], [], "m", "f", generation=1) == 2


def test_a_store_that_is_a_special_file_is_refused(tmp_path: Path) -> None:
    import os

    os.mkfifo(tmp_path / "fifo.db")
    with pytest.raises(StateError, match="not a regular file"):
        ConversationStore(tmp_path / "fifo.db")


BAD_ROWS = [
    ("strings", "'x', 'm', 'f', '[]', '[]', 'many', 'few', x'00', 'yesterday'"),
    ("negative", "'x', 'm', 'f', '[]', '[]', -5, -1, x'00', -3.0"),
    ("not a blob", "'x', 'm', 'f', '[]', '[]', 1, 1, 'text state', 1e300"),
    ("wrong types", "'x', 7, x'ff', 'not json', 'not json', 2.5, 1, 12, 1.0"),
]


def damaged_store(path: Path, values: str) -> Path:
    with ConversationStore(path) as s:
        s.save("fine", b"state", [1, 2], MSG, "m", "f")
    con = sqlite3.connect(path)
    con.execute(f"INSERT INTO conversations VALUES ({values}, 1)")
    con.commit()
    con.close()
    return path


@pytest.mark.parametrize(("case", "values"), BAD_ROWS, ids=[c for c, _ in BAD_ROWS])
def test_a_damaged_row_is_listed_as_damaged(tmp_path: Path, case: str, values: str) -> None:
    with ConversationStore(damaged_store(tmp_path / "c.db", values)) as s:
        rows = {r.name: r for r in s.list()}
        assert rows["fine"].damaged == "" and rows["fine"].n_tokens == 2
        bad = rows["x"]
        assert bad.damaged.startswith("bad ")
        assert bad.n_tokens >= 0 and bad.n_messages >= 0 and bad.n_bytes >= 0
        assert s.get("x") == bad


def test_a_damaged_row_cannot_be_loaded_but_says_why(tmp_path: Path) -> None:
    s = ConversationStore(damaged_store(tmp_path / "c.db", BAD_ROWS[3][1]))
    with pytest.raises(StateError, match="conversation 'x' is damaged"):
        s.messages("x")
    s.close()
    s = ConversationStore(damaged_store(tmp_path / "d.db", BAD_ROWS[2][1]))
    with pytest.raises(StateError, match="conversation 'x' is damaged"):
        s.load("x")
    s.close()


def test_a_save_over_another_processs_save_is_refused(tmp_path: Path) -> None:
    a, b = ConversationStore(tmp_path / "c.db"), ConversationStore(tmp_path / "c.db")
    a.save("chat", b"v1", [1], MSG, "m", "f")
    held_a, held_b = a.load_generation("chat"), b.load_generation("chat")
    assert held_a is not None and held_b is not None and held_a == held_b == (b"v1", 1)
    assert a.save("chat", b"a's turn", [1, 2], MSG, "m", "f", generation=held_a[1]) == 2
    with pytest.raises(ConversationConflictError, match="saved by another process"):
        b.save("chat", b"b's turn", [1, 3], MSG, "m", "f", generation=held_b[1])
    assert b.load("chat") == b"a's turn"  # the first writer's turn is kept
    with pytest.raises(ConversationConflictError):  # a new name someone else took meanwhile
        b.save("chat", b"b's turn", [1, 3], MSG, "m", "f", generation=0)
    assert b.save("chat", b"forced", [1], MSG, "m", "f") == 3  # no generation: replaces
    a.close()
    b.close()


@pytest.mark.parametrize("name", ["a" * 5000, "file/below"])
def test_a_store_path_the_system_refuses_is_one_error(tmp_path: Path, name: str) -> None:
    """Found by the CLI fuzzer: a name too long (or a 'folder' that is a file) escaped as OSError."""
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(StateError, match="conversation store"):
        ConversationStore(tmp_path / name)


def _store_with_a_row(path: Path) -> None:
    with ConversationStore(path) as s:
        s.save("kept", b"state", [1, 2], [{"role": "user", "content": "hi"}], "m", "f")


def test_a_readonly_open_changes_no_store(tmp_path: Path) -> None:
    path = tmp_path / "chats.db"
    _store_with_a_row(path)
    before = digest(path)
    with ConversationStore(path, readonly=True) as s:
        assert [r.name for r in s.list()] == ["kept"]
    assert digest(path) == before  # (SQLite's -wal and -shm files may stay beside it, empty)
    with pytest.raises(StateError, match="no conversation store"):
        ConversationStore(tmp_path / "none.db", readonly=True)
    assert not (tmp_path / "none.db").exists()


def test_state_list_reads_a_store_on_a_readonly_mount(tmp_path: Path) -> None:
    """`state list` could not read a store on a read-only mount (issue 28, item 10): it opened
    the store for writing, and SQLite cannot make a WAL store's shared memory there. Run in a
    user and mount namespace of its own, where the folder is bound read-only."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    rw, ro = tmp_path / "rw", tmp_path / "ro"
    rw.mkdir()
    ro.mkdir()
    _store_with_a_row(rw / "chats.db")
    kvtool_cmd = f"{sys.executable} -m kvtool.commands state list --store {ro / 'chats.db'}"
    script = f"mount --bind {rw} {ro} && mount -o remount,ro,bind {ro} && {kvtool_cmd}"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount --bind {rw} {ro}"], capture_output=True)
    if probe.returncode:
        pytest.skip("no user and mount namespaces here")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "kept" in r.stdout, r.stderr
