"""The disk prompt cache (--cache-dir): slot states that fall out of the RAM tier (and all of
them at shutdown) are kept as kvtool state files, so a restarted server, or another one on the
same folder, finds them. One file per entry, named by the hash of its model and tokens and
written atomically; an SQLite index (WAL, one transaction per change) lists them with their
tokens, sizes and last use, so that several servers share a folder without corrupting it.
Bounded in bytes: the least recently used entries are deleted first. A file is verified whole
before it touches a slot (checksum, model fingerprint, memory layout, tokens): a corrupt or
truncated one is reported, unlisted and deleted; one of another model or layout is reported and
passed over; neither is ever loaded. A PrefixSource of the scheduler, on its thread only."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import kvtool
from kvtool.common import slot_state
from kvtool.common.ram_cache import MIN_KEEP, Entry, TierStats

if TYPE_CHECKING:
    from kvtool.common.slots import Slot

INDEX = "index.sqlite"
SUFFIX = ".state"
APPLICATION_ID = 0x6B766463  # "kvdc": whose index this is
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key       TEXT PRIMARY KEY,   -- the file's name without SUFFIX
    model     TEXT NOT NULL,      -- kvtool.Model.fingerprint
    n_tokens  INTEGER NOT NULL,
    tokens    BLOB NOT NULL,      -- int32 little endian
    nbytes    INTEGER NOT NULL,
    last_used REAL NOT NULL
);
"""


def refusal(e: kvtool.StateError) -> str:
    """Why a file was refused, in one word: truncated, foreign (another model or memory layout),
    missing, or corrupt."""
    msg = str(e)
    if msg.startswith("truncated"):
        return "truncated"
    if msg.startswith(("corrupted", "not a kvtool state")):
        return "corrupt"
    if msg.startswith(("no state file", "cannot read")):
        return "missing"
    return "foreign"  # a sound state that does not fit: another model, memory layout, not a slot's


class DiskCache:
    """Slot states in `folder`, at most `max_bytes` of files (-1: no limit). `report` hears
    each refused file (one line)."""

    name = "disk"
    shared = False

    def __init__(
        self, folder: Path, model: kvtool.Model, max_bytes: int, report: Callable[[str], None] | None = None
    ) -> None:
        self.folder = folder
        self.model_key = model.fingerprint
        self.max_bytes = max_bytes
        self.report = report
        self.stats = TierStats()
        self.refused: dict[str, int] = {}  # by reason
        self._skip: set[str] = set()  # keys this server will not try again (another layout)
        self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        path = self.folder / INDEX
        try:
            db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
            app_id = db.execute("PRAGMA application_id").fetchone()[0]
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as e:
            raise kvtool.KvtoolError(
                f"--cache-dir {self.folder}: {INDEX} is not a usable index ({e})"
            ) from None
        if tables - {"entries"} or (tables and app_id != APPLICATION_ID):
            db.close()
            raise kvtool.KvtoolError(f"--cache-dir {self.folder}: {INDEX} belongs to something else")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        db.executescript(_SCHEMA)
        return db

    def close(self) -> None:
        self.db.close()

    # -- what it holds ---------------------------------------------------------------------------
    @property
    def entries(self) -> list[tuple[str, int]]:
        """(key, bytes) of this model's entries."""
        rows = self.db.execute("SELECT key, nbytes FROM entries WHERE model = ?", (self.model_key,))
        return [(str(k), int(n)) for k, n in rows]

    @property
    def nbytes(self) -> int:
        return int(self.db.execute("SELECT coalesce(sum(nbytes), 0) FROM entries").fetchone()[0])

    def _key(self, tokens: Sequence[int]) -> str:
        h = hashlib.sha256(self.model_key.encode())
        h.update(np.asarray(tokens, dtype="<i4").tobytes())
        return h.hexdigest()[:40]

    # -- PrefixSource ----------------------------------------------------------------------------
    def offer(self, ctx: kvtool.Context, slot: Slot) -> None:
        """Slots reach the disk through the RAM tier (its `on_evict`)."""
        return None

    def put(self, entry: Entry) -> None:
        """Writes an entry's file atomically and lists it; then deletes the least recently used
        entries (of any model) beyond the budget."""
        if 0 <= self.max_bytes < entry.nbytes:
            self.stats.n_refused += 1
            return
        key = self._key(entry.tokens)
        try:
            slot_state.write_file(self.folder / f"{key}{SUFFIX}", entry.data)
        except kvtool.StateError as e:
            self._refuse(key, "unwritable", e)
            return
        tokens = np.asarray(entry.tokens, dtype="<i4").tobytes()
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?)",
                (key, self.model_key, len(entry.tokens), tokens, entry.nbytes, time.time()),
            )
            gone = self._over_budget(db)
        self.stats.n_saved += 1
        self.stats.n_evicted += len(gone)
        for k in gone:
            (self.folder / f"{k}{SUFFIX}").unlink(missing_ok=True)

    def _over_budget(self, db: sqlite3.Connection) -> list[str]:
        if self.max_bytes < 0:
            return []
        gone, total = [], int(db.execute("SELECT coalesce(sum(nbytes), 0) FROM entries").fetchone()[0])
        for key, n in db.execute("SELECT key, nbytes FROM entries ORDER BY last_used").fetchall():
            if total <= self.max_bytes:
                break
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
            gone.append(str(key))
            total -= int(n)
        return gone

    def best(self, tokens: Sequence[int]) -> tuple[str, tuple[int, ...], int]:
        """The listed entry sharing the longest prefix with `tokens` (all but its last token at
        most; an entry that would keep under a quarter of its tokens is passed over): its key,
        tokens and that length; ("", (), 0) for none."""
        want = np.asarray(tokens, dtype=np.int64)
        cap = len(want) - 1
        best: tuple[str, tuple[int, ...], int] = ("", (), 0)
        rows = self.db.execute("SELECT key, tokens FROM entries WHERE model = ?", (self.model_key,))
        for key, blob in rows:
            if key in self._skip:
                continue
            have = np.frombuffer(blob, dtype="<i4").astype(np.int64)
            m = min(len(have), len(want))
            diff = np.flatnonzero(have[:m] != want[:m])
            n = min(int(diff[0]) if diff.size else m, cap)
            if n > best[2] and n >= MIN_KEEP * len(have):
                best = (str(key), tuple(int(t) for t in have), n)
        return best

    def restore(self, ctx: kvtool.Context, slot: Slot, tokens: Sequence[int], n_have: int) -> int:
        while True:  # a refused entry is unlisted: the next best is tried
            key, held, n = self.best(tokens)
            if n <= n_have:
                return n_have
            try:
                data = slot_state.read_file(self.folder / f"{key}{SUFFIX}")
                info = kvtool.inspect_state(data)
                if info.model.get("fingerprint") != self.model_key:
                    raise kvtool.StateError(
                        f"state was saved with another model ({info.model.get('name')!s:.40})"
                    )
                if info.tokens() != list(held):
                    raise kvtool.StateError("corrupted state: its tokens are not those its index lists")
                slot_state.restore(ctx, slot, data)
            except kvtool.StateError as e:
                self._refuse(key, refusal(e), e)
                continue
            with self._transaction() as db:
                db.execute("UPDATE entries SET last_used = ? WHERE key = ?", (time.time(), key))
            self.stats.n_hits += 1
            return n

    def _refuse(self, key: str, reason: str, e: Exception) -> None:
        """A file that cannot serve: reported; a broken one is unlisted and deleted, one made
        for another layout is left to the servers it suits."""
        self.stats.n_failed += 1
        self.refused[reason] = self.refused.get(reason, 0) + 1
        if self.report is not None:
            self.report(f"cache-dir: {key}{SUFFIX} refused ({reason}): {e}")
        if reason == "foreign":
            self._skip.add(key)
            return
        with self._transaction() as db:
            db.execute("DELETE FROM entries WHERE key = ?", (key,))
        if reason != "unwritable":
            (self.folder / f"{key}{SUFFIX}").unlink(missing_ok=True)

    def _transaction(self) -> _Tx:
        return _Tx(self.db)


class _Tx:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): writers of several servers take turns."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
