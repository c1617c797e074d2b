"""The SQLite conversation store: round trips, and two processes saving at once."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.common.store import ConversationStore
from kvtool.errors import StateError

MSG = [{"role": "user", "content": "héllo"}]


def test_save_load_list_delete(tmp_path: Path) -> None:
    with ConversationStore(tmp_path / "c.db") as s:
        assert s.list() == [] and s.load("a") is None
        s.save("a", b"state-a", [1, 2, 3], MSG, "tiny", "fp")
        s.save("b", b"state-b", [4], [], "tiny", "fp")
        s.save("a", b"state-a2", [1, 2, 3, 4], MSG * 2, "tiny", "fp")  # replaces
        assert s.load("a") == b"state-a2" and s.messages("a") == MSG * 2
        rec = s.get("a")
        assert rec is not None and (rec.n_tokens, rec.n_messages, rec.n_bytes) == (4, 2, 8)
        assert [r.name for r in s.list()] == ["a", "b"]  # most recent first
        assert s.delete("b") and not s.delete("b")
    with ConversationStore(tmp_path / "c.db") as s:  # persisted
        assert [r.name for r in s.list()] == ["a"]


def test_not_a_store(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateError, match="not a usable conversation store"):
        ConversationStore(bad)
    with pytest.raises(StateError, match="directory"):
        ConversationStore(tmp_path)
    with pytest.raises(StateError, match="needs a name"), ConversationStore(tmp_path / "ok.db") as s:
        s.save("", b"", [], [], "m", "f")


WRITER = """
import sys
from kvtool.common.store import ConversationStore
db, w = sys.argv[1], int(sys.argv[2])
with ConversationStore(db) as s:
    for i in range(40):
        blob = bytes([w]) * 65536 + i.to_bytes(4, "little")
        msgs = [{"role": "user", "content": f"{w}:{i}"}]
        s.save(f"w{w}-{i % 5}", blob, [w, i], msgs, "m", "fp")
        s.save("shared", blob, [w, i], msgs, "m", "fp")
"""


def test_two_processes_share_a_store(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(w)], stderr=subprocess.PIPE, text=True)
        for w in (1, 2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = con.execute("SELECT name, tokens, messages, state FROM conversations").fetchall()
    con.close()
    assert sorted(r[0] for r in rows) == sorted([f"w{w}-{i}" for w in (1, 2) for i in range(5)] + ["shared"])
    for _, tokens, messages, state in rows:  # every row is one whole save, never a mix
        w, i = json.loads(tokens)
        assert state == bytes([w]) * 65536 + i.to_bytes(4, "little")
        assert f'"{w}:{i}"' in messages
