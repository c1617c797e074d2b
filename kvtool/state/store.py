"""A conversation store: many named conversations in one SQLite file (stdlib sqlite3).

Each row keeps a conversation's token ids, its messages and its sequence state (a container
of docs/state-format.md). Every save is one transaction (BEGIN IMMEDIATE ... COMMIT); SQLite's
file locking and the WAL journal let several processes share a store without corrupting it:
a writer waits (up to `timeout` seconds) for another's transaction to finish."""

from __future__ import annotations

import builtins
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtool.errors import StateError

SCHEMA_VERSION = "1"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS kvtool_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS conversations (
    name        TEXT PRIMARY KEY,
    model       TEXT NOT NULL,      -- the model's name
    fingerprint TEXT NOT NULL,      -- the model's fingerprint (kvtool.Model.fingerprint)
    tokens      TEXT NOT NULL,      -- JSON list of the token ids held in the state
    messages    TEXT NOT NULL,      -- JSON list of {"role", "content"}
    n_tokens    INTEGER NOT NULL,
    n_messages  INTEGER NOT NULL,
    state       BLOB NOT NULL,      -- a sequence state (docs/state-format.md)
    updated     REAL NOT NULL       -- seconds since the epoch
);
"""
_COLUMNS = "name, model, fingerprint, n_tokens, n_messages, length(state), updated"


@dataclass(frozen=True)
class ConversationRecord:
    """One stored conversation, without its state."""

    name: str
    model: str
    fingerprint: str
    n_tokens: int
    n_messages: int
    n_bytes: int
    updated: float


class ConversationStore:
    """Named conversations in a SQLite file, shared safely between processes."""

    def __init__(self, path: str | Path, timeout: float = 30.0) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise StateError(f"{self.path} is a directory, not a conversation store")
        try:
            self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
            self._wal(timeout)
            self._db.execute("PRAGMA synchronous=FULL")
            with self._transaction() as db:
                for statement in _SCHEMA.split(";")[:-1]:
                    db.execute(statement)
                row = db.execute("SELECT value FROM kvtool_meta WHERE key = 'schema'").fetchone()
                if row is None:
                    db.execute("INSERT INTO kvtool_meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
                elif row[0] != SCHEMA_VERSION:
                    raise StateError(f"{self.path}: store schema {row[0]} is not supported")
        except sqlite3.DatabaseError as e:
            raise StateError(f"{self.path} is not a usable conversation store ({e})") from None

    def _wal(self, timeout: float) -> None:
        """Switches to WAL. SQLite answers "locked" at once (no busy wait) while another process
        holds the file during its own switch, so wait here as the busy timeout would."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: the lock is taken at BEGIN, so a second writer waits there."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def save(
        self,
        name: str,
        state: bytes,
        tokens: Sequence[int],
        messages: Sequence[dict[str, str]],
        model: str,
        fingerprint: str,
    ) -> None:
        """Creates or replaces conversation `name` (one transaction)."""
        if not name:
            raise StateError("a conversation needs a name")
        row = (
            name,
            model,
            fingerprint,
            json.dumps([int(t) for t in tokens]),
            json.dumps(list(messages), ensure_ascii=False),
            len(tokens),
            len(messages),
            sqlite3.Binary(state),
            time.time(),
        )
        try:
            with self._transaction() as db:
                db.execute("INSERT OR REPLACE INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
        except sqlite3.DatabaseError as e:
            raise StateError(f"{self.path}: cannot save conversation '{name}' ({e})") from None

    def load(self, name: str) -> bytes | None:
        """The state of conversation `name`, or None if the store has no such conversation."""
        row = self._query("SELECT state FROM conversations WHERE name = ?", (name,))
        return bytes(row[0][0]) if row else None

    def messages(self, name: str) -> builtins.list[dict[str, str]] | None:
        row = self._query("SELECT messages FROM conversations WHERE name = ?", (name,))
        return json.loads(row[0][0]) if row else None

    def get(self, name: str) -> ConversationRecord | None:
        rows = self._query(f"SELECT {_COLUMNS} FROM conversations WHERE name = ?", (name,))
        return ConversationRecord(*rows[0]) if rows else None

    def list(self) -> builtins.list[ConversationRecord]:
        """Every conversation, most recently saved first."""
        rows = self._query(f"SELECT {_COLUMNS} FROM conversations ORDER BY updated DESC, name", ())
        return [ConversationRecord(*r) for r in rows]

    def delete(self, name: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM conversations WHERE name = ?", (name,)).rowcount > 0

    def _query(self, sql: str, args: tuple[object, ...]) -> builtins.list[tuple[Any, ...]]:
        try:
            return self._db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as e:
            raise StateError(f"{self.path}: {e}") from None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
