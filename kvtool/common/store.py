"""A conversation store: many named conversations in one SQLite file (stdlib sqlite3).

Each row keeps a conversation's token ids, its messages and its sequence state (a container
of docs/state-format.md). Every save is one transaction (BEGIN IMMEDIATE ... COMMIT); SQLite's
file locking and the WAL journal let several processes share a store without corrupting it:
a writer waits (up to `timeout` seconds) for another's transaction to finish."""

from __future__ import annotations

import builtins
import json
import os
import sqlite3
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from kvtool.errors import StateError

SCHEMA_VERSION = "2"  # 2: rows carry a generation (a writer saves over the one it read)
APPLICATION_ID = 0x6B76746C  # "kvtl" in SQLite's application_id: whose file this is
_SQLITE_MAGIC = b"SQLite format 3\x00"
_TABLES = {"kvtool_meta", "conversations"}
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
    updated     REAL NOT NULL,      -- seconds since the epoch
    generation  INTEGER NOT NULL DEFAULT 1  -- 1 at the first save, +1 at each save
);
"""
_COLUMNS = "name, model, fingerprint, n_tokens, n_messages, length(state), updated, typeof(state)"


class ConversationConflictError(StateError):
    """Another process saved the conversation since this one loaded it: saving would drop
    that process's turns, so nothing was written."""


@dataclass(frozen=True)
class ConversationRecord:
    """One stored conversation, without its state. `damaged` says why a row with impossible
    values cannot be used (its numbers then read 0); "" for a sound row."""

    name: str
    model: str
    fingerprint: str
    n_tokens: int
    n_messages: int
    n_bytes: int
    updated: float
    damaged: str = ""


def _record(row: tuple[Any, ...]) -> ConversationRecord:
    """A listing row, checked: a row written by another program or damaged by hand lists as
    damaged instead of breaking the listing."""
    name, model, fingerprint, n_tokens, n_messages, n_bytes, updated, state_type = row
    bad = [
        field
        for field, value, ok in (
            ("name", name, isinstance(name, str)),
            ("model", model, isinstance(model, str)),
            ("fingerprint", fingerprint, isinstance(fingerprint, str)),
            ("n_tokens", n_tokens, isinstance(n_tokens, int) and n_tokens >= 0),
            ("n_messages", n_messages, isinstance(n_messages, int) and n_messages >= 0),
            ("state", state_type, state_type == "blob"),
            ("updated", updated, isinstance(updated, int | float) and 0 <= updated < 1e11),
        )
        if not ok
    ]

    def text(v: object) -> str:
        return v if isinstance(v, str) else repr(v)

    def count(v: object) -> int:
        return v if isinstance(v, int) and v >= 0 else 0

    return ConversationRecord(
        text(name),
        text(model),
        text(fingerprint),
        count(n_tokens),
        count(n_messages),
        count(n_bytes) if state_type == "blob" else 0,
        float(updated) if "updated" not in bad else 0.0,
        f"bad {', '.join(bad)}" if bad else "",
    )


def _connect_readonly(path: Path, timeout: float = 5.0) -> sqlite3.Connection:
    """A read-only connection. On a read-only mount SQLite cannot make a WAL store's
    shared-memory file: the file is then opened as immutable (nothing there can change it)."""
    uri = path.resolve().as_uri()
    error: sqlite3.DatabaseError | None = None
    for query in ("mode=ro", "mode=ro&immutable=1"):
        db = None
        try:
            db = sqlite3.connect(f"{uri}?{query}", uri=True, timeout=timeout)
            db.execute("PRAGMA application_id").fetchone()
            return db
        except sqlite3.DatabaseError as e:
            error = e
            if db is not None:
                db.close()
    assert error is not None
    raise error


def _open_readonly(path: Path, timeout: float) -> sqlite3.Connection:
    """An existing kvtool store, opened for reading only."""
    if not path.is_file():
        raise StateError(f"no conversation store {path}")
    _check_foreign(path)
    try:
        db = _connect_readonly(path, timeout)
        row = db.execute("SELECT value FROM kvtool_meta WHERE key = 'schema'").fetchone()
    except sqlite3.DatabaseError as e:
        raise StateError(f"{path} is not a usable conversation store ({e})") from None
    if row is None or row[0] not in ("1", SCHEMA_VERSION):
        db.close()
        raise StateError(f"{path}: a store schema this version does not read")
    return db


def _check_foreign(path: Path) -> None:
    """Refuses, without writing a byte, an existing file that is not a kvtool store: not
    SQLite, or the database of another program (its tables, or its application_id)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as e:
        raise StateError(f"cannot open the conversation store {path}: {e.strerror}") from None
    if not head:
        return  # an empty file: a new store
    if head != _SQLITE_MAGIC:
        raise StateError(f"{path} is not a SQLite file: not a usable conversation store")
    try:
        db = _connect_readonly(path)
        try:
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        raise StateError(f"{path} is not a usable conversation store ({e})") from None
    if app_id not in (0, APPLICATION_ID) or (tables and "kvtool_meta" not in tables):
        theirs = ", ".join(sorted(tables - _TABLES)[:4]) or f"application_id {app_id:#x}"
        raise StateError(f"{path} is another program's SQLite database ({theirs}), not a kvtool store")


class ConversationStore:
    """Named conversations in a SQLite file, shared safely between processes. An existing
    file is opened only if it is a kvtool store (or empty): another program's database is
    refused untouched. `readonly` opens an existing store for reading only, without writing a
    byte (a listing; a store on a read-only mount)."""

    def __init__(self, path: str | Path, timeout: float = 30.0, *, readonly: bool = False) -> None:
        self.path = Path(path)
        if readonly:
            self._db = _open_readonly(self.path, timeout)
            return
        try:
            mode: int | None = os.stat(self.path).st_mode
        except FileNotFoundError:
            mode = None  # a new store
        except OSError as e:  # a name too long, a folder that is a file, no permission...
            raise StateError(f"cannot open the conversation store {self.path}: {e.strerror}") from None
        if mode is not None and stat.S_ISDIR(mode):
            raise StateError(f"{self.path} is a directory, not a conversation store")
        if mode is not None:
            if not stat.S_ISREG(mode):
                raise StateError(f"{self.path} is not a regular file, not a conversation store")
            _check_foreign(self.path)
        try:
            self._db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        except sqlite3.DatabaseError as e:
            raise StateError(f"cannot open the conversation store {self.path} ({e})") from None
        try:
            self._wal(timeout)
            self._db.execute("PRAGMA synchronous=FULL")
            with self._transaction() as db:
                for statement in _SCHEMA.split(";")[:-1]:
                    db.execute(statement)
                db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                self._upgrade(db)
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise StateError(f"{self.path} is not a usable conversation store ({e})") from None
        except BaseException:
            self._db.close()
            raise

    def _upgrade(self, db: sqlite3.Connection) -> None:
        """Records the schema of a new store; brings a version-1 store to version 2."""
        row = db.execute("SELECT value FROM kvtool_meta WHERE key = 'schema'").fetchone()
        if row is None:
            db.execute("INSERT INTO kvtool_meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        elif row[0] == "1":
            db.execute("ALTER TABLE conversations ADD COLUMN generation INTEGER NOT NULL DEFAULT 1")
            db.execute("UPDATE kvtool_meta SET value = ? WHERE key = 'schema'", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise StateError(f"{self.path}: store schema {row[0]} is not supported")

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
        *,
        generation: int | None = None,
    ) -> int:
        """Creates or replaces conversation `name` (one transaction); returns its new generation.
        `generation` is the one this writer loaded or last saved (0: it had none): when the
        stored row has another, another process saved since, and ConversationConflictError
        leaves the row as it is. None replaces whatever is stored."""
        if not name:
            raise StateError("a conversation needs a name")
        row = (
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
                now = db.execute("SELECT generation FROM conversations WHERE name = ?", (name,)).fetchone()
                held = 0 if now is None else now[0]
                if generation is not None and held != generation:
                    raise ConversationConflictError(
                        f"conversation '{name}' was saved by another process since this one loaded it"
                    )
                new = (held if isinstance(held, int) else 0) + 1
                db.execute(
                    "INSERT OR REPLACE INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (name, *row, new),
                )
        except sqlite3.DatabaseError as e:
            raise StateError(f"{self.path}: cannot save conversation '{name}' ({e})") from None
        return new

    def load(self, name: str) -> bytes | None:
        """The state of conversation `name`, or None if the store has no such conversation."""
        held = self.load_generation(name)
        return None if held is None else held[0]

    def load_generation(self, name: str) -> tuple[bytes, int] | None:
        """(state, generation) of conversation `name` (None if there is none): a writer saves
        back with that generation, so that a save by another process in between is detected."""
        rows = self._query("SELECT state, generation FROM conversations WHERE name = ?", (name,))
        if not rows:
            return None
        state, generation = rows[0]
        if not isinstance(state, bytes) or not isinstance(generation, int):
            raise StateError(f"{self.path}: conversation '{name}' is damaged")
        return state, generation

    def messages(self, name: str) -> builtins.list[dict[str, str]] | None:
        row = self._query("SELECT messages FROM conversations WHERE name = ?", (name,))
        if not row:
            return None
        try:
            msgs = json.loads(row[0][0])
        except (TypeError, ValueError):
            msgs = None
        if not isinstance(msgs, list):
            raise StateError(f"{self.path}: conversation '{name}' is damaged")
        return msgs

    def get(self, name: str) -> ConversationRecord | None:
        rows = self._query(f"SELECT {_COLUMNS} FROM conversations WHERE name = ?", (name,))
        return _record(rows[0]) if rows else None

    def list(self) -> builtins.list[ConversationRecord]:
        """Every conversation, most recently saved first; a damaged row is listed as such
        (`ConversationRecord.damaged`), never an error."""
        rows = self._query(f"SELECT {_COLUMNS} FROM conversations", ())
        records = [_record(r) for r in rows]
        return sorted(records, key=lambda r: (-r.updated, r.name))

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
