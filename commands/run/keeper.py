"""Where `run` keeps conversations: a session file, a store of named ones, or nowhere.

A turn is kept as it completes (`Keeper.keep`), not only at exit: whatever ends the process
afterwards (SIGTERM, a closed terminal, SIGKILL, a crash), the turns the user saw are saved.
A save the process did not ask for never replaces another process's newer save: a session
file saved by another chat meanwhile (or a stored conversation, see pool.py) is kept beside
it under a new name (`chat~2.kvs`), and the chat says so. A save that fails (a full disk, a
store locked for longer than its timeout) is one error line, and the conversation is rescued
(rescue.py) where the line says."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import kvtool
from kvtool.commands.common import signals
from kvtool.commands.common.text import lazy_console
from kvtool.commands.run import rescue
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.pool import ConversationPool
from kvtool.common import files
from kvtool.common.store import ConversationConflictError, ConversationStore

err = lazy_console(stderr=True)


def say(text: str, style: str = "") -> None:
    """A note on stderr, which may be gone (a closed terminal): a save never fails on its note."""
    with contextlib.suppress(OSError, ValueError):
        err.print(text, markup=False, style=style)


def _note(text: str) -> None:
    say(f"({text})", style="yellow")


def _count(messages: list[dict[str, str]]) -> str:
    """A conversation's size as a user counts it: its turns (a user message and its reply)."""
    n = sum(m["role"] == "user" for m in messages)
    return f"{n} turn{'s' if n != 1 else ''}"


def _absolute(name: str) -> Path:
    """A file name the user typed, relative to where kvtool runs; symlinks are left to the
    writer and reader (resolving one that loops would raise)."""
    return Path(os.path.abspath(Path(name).expanduser()))


class Keeper:
    """Where conversations are kept: a session file (like llama-cli's prompt cache), a store of
    named conversations sharing the model, or nowhere. `/save NAME` and `/load NAME` go to
    files, or with a store to its conversations (`/load` switches)."""

    def __init__(
        self,
        ctx: kvtool.Context,
        new_session: Callable[[int], ChatSession],
        session_file: Path | None,
        store: ConversationStore | None,
        name: str,
    ) -> None:
        """`store` is opened by the caller (before the model loads: a wrong file is refused
        early); the keeper closes it."""
        self.file = session_file
        self.version: files.FileVersion | None = None
        self.pool = None if store is None else ConversationPool(ctx, store, new_session, _note)
        self.name = name
        self.failed: str | None = None  # why the last save of a conversation failed (it was rescued)
        self._rescued: dict[str, Path] = {}  # what could not be saved -> where it went
        self._said: dict[str, str] = {}  # the last error line about each
        self._dirty: set[str] = set()  # conversations (store names; "" for the session) not yet kept
        self.resumed: str | None = None  # what was resumed, as `run` says it after its banner
        # without --session or --store: the last /save NAME, and the changes since (not kept)
        self._snapshot: str | None = None
        self._changed_since = False
        if self.pool is not None:
            self.session = self.pool.open(name)
            if self.session.messages or self.session.cached:
                self.resumed = f"conversation '{name}' of the store: {self._summary()}"
            return
        self.session = new_session(0)
        if session_file is not None:
            self.version = files.FileVersion(session_file)  # before reading: a save since is seen
            if session_file.exists():
                self.session.load_state(session_file)
                self.resumed = f"resumed {session_file}: {self._summary()}"

    def _summary(self) -> str:
        return f"{_count(self.session.messages)}, {len(self.session.cached)} tokens"

    # -- what the user asks for -----------------------------------------------------------------
    def save(self, name: str) -> str:
        if self.pool is not None:
            if name == self.name:
                try:  # another process's save since ours is refused, not overwritten
                    self.pool.save(self.name)
                except ConversationConflictError as e:
                    raise ConversationConflictError(f"{e}; /save NEW keeps this one") from None
                self._dirty.discard(name)
            else:
                self.pool.save(self.name, as_name=name)
            return f"saved as '{name}' in the store {self.pool.store.path}"
        path = _absolute(name)
        with signals.held():
            n = self.session.save_state(path)
        if self.file is None:
            self._snapshot, self._changed_since = name, False
        return f"saved to {path}: {n:,} bytes; /load {name} or --session {name} resumes it"

    def load(self, name: str) -> str:
        if self.pool is not None:
            known = name in {r.name for r in self.pool.store.list()}
            with signals.held():
                self._keep_one(self.name)
            try:
                self.session, self.name = self.pool.open(name), name
            except BaseException:  # the current one may have been evicted to make room: back to it
                self.session = self.pool.open(self.name)
                raise
            if not known:  # a store's /load switches, so a new name starts a conversation
                return f"no conversation '{name}' in the store: started it empty"
            return f"conversation '{name}': {self._summary()}"
        path = _absolute(name)
        if not path.exists():
            raise kvtool.StateError(f"no saved conversation at {path}")
        self.session.load_state(path)  # all checked first: a failed load changes nothing
        self.changed()
        return f"loaded {path}: {self._summary()}"

    def kept_where(self) -> str | None:
        """Where the conversation is kept, as the chat says it when it ends normally (Ctrl-D,
        /exit): None when there is no such place or nothing was ever written there; without
        --session, that what changed since a /save is not kept."""
        if self.failed is not None:
            return None  # its error line said where it went
        if self.pool is not None:
            if not self.session.messages:
                return None
            n = _count(self.session.messages)
            return f"conversation '{self.name}' kept in the store {self.pool.store.path}: {n}"
        if self.file is None:
            if self._snapshot is None or not self._changed_since:
                return None
            name = self._snapshot  # /save keeps what the conversation was, not what came after
            return (
                f"the conversation changed since /save {name} and is not kept: "
                f"/save {name} again keeps it, --session FILE keeps every turn"
            )
        if not self.file.exists():
            return None
        return f"saved to {self.file}: {_count(self.session.messages)}; --session {self.file} resumes it"

    def listing(self) -> str:
        if self.pool is None:
            return "no store (use --store DB)"
        try:
            rows = self.pool.store.list()
        except kvtool.StateError as e:  # a locked or broken store: the chat goes on
            return f"cannot list the store: {e}"
        return ", ".join(
            f"{r.name}{'*' if r.name == self.name else ''} ({r.damaged or r.n_messages})" for r in rows
        )

    # -- keeping --------------------------------------------------------------------------------
    def touch(self) -> None:
        """The current conversation is about to change (a turn begins): whatever ends it, `finish`
        saves it."""
        self._dirty.add(self.name if self.pool is not None else "")

    def changed(self) -> None:
        """The current conversation changed (a turn, /clear, /load): it is saved now."""
        self.touch()
        if self.pool is None and self.file is None:
            self._changed_since = True
            return
        with signals.held():  # a signal meanwhile comes once the save is whole
            self._keep_one(self.name if self.pool is not None else "")

    def finish(self) -> None:
        """Saves what is not saved yet (every open conversation of a store) and closes the store.
        A conversation that cannot be saved is rescued; `failed` says so."""
        with signals.held():
            if self.pool is not None:
                for name in self.pool.active:
                    if name in self._dirty:
                        self._keep_one(name)
                self.pool.close_all(save=False)
                self.pool.store.close()
            elif self.file is not None and "" in self._dirty:
                self._keep_one("")

    def _keep_one(self, key: str) -> None:
        """Saves one conversation (a store name, or "" for the session file) where it belongs,
        or rescues it and says where."""
        label = str(self.file) if not key else f"'{key}' of the store"
        session = self.session if self.pool is None else self.pool.session(key)
        try:
            if self.pool is None:
                self._save_session()
            else:
                stored = self.pool.keep(key)  # another process's save meanwhile: kept as key~2
                if key == self.name:
                    self.name = stored
                if stored != key:
                    self._dirty.discard(key)
                    key = stored
        except (kvtool.KvtoolError, OSError) as e:
            self._rescue(key, label, session, e)
            return
        self._dirty.discard(key)
        gone = self._rescued.pop(key, None)
        if gone is not None:
            with contextlib.suppress(OSError):
                gone.unlink()
            _note(f"saved {label} again; the rescued copy {gone} is removed")
        if self._said.pop(key, None) is not None and not self._said:
            self.failed = None

    def _save_session(self) -> None:
        assert self.file is not None and self.version is not None
        data = self.session.state_data()
        try:
            files.write_file(self.file, data, files.STATE_FILE, version=self.version)
            return
        except files.FileChanged:
            pass
        stem, suffix, k = self.file.stem, self.file.suffix, 2
        while True:  # another chat saved this session since: keep ours beside it
            fork = self.file.with_name(f"{stem}~{k}{suffix}")
            version = files.FileVersion(fork)
            if version.stamp is None:
                with contextlib.suppress(files.FileChanged):
                    files.write_file(fork, data, files.STATE_FILE, version=version)
                    break
            k += 1
        _note(f"{self.file} was saved by another process meanwhile: this conversation is kept as {fork}")
        self.file, self.version = fork, version

    def _rescue(self, key: str, label: str, session: ChatSession, e: Exception) -> None:
        why = (e.strerror if isinstance(e, OSError) else None) or str(e)
        old = self._rescued.get(key)
        try:
            data: bytes | None = session.state_data()
        except kvtool.KvtoolError:  # (a model file cut short): the messages alone are kept
            data = None
        where = rescue.rescue(data, session.messages, old.stem if old else rescue.name_for(label))
        if where is None:
            line = f"cannot save the conversation {label} ({why}), and nowhere else would take it"
        else:
            if old is not None and old != where:
                with contextlib.suppress(OSError):
                    old.unlink()
            self._rescued[key] = where
            line = f"cannot save the conversation {label} ({why}); it is kept in {where}"
            if where.suffix == ".kvs":
                line += f" (kvtool run --session {where} resumes it)"
        self.failed = line
        if self._said.get(key) != line:  # once, not at every turn while the disk stays full
            self._said[key] = line
            say(f"error: {line}", style="red")
