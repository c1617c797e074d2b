"""Where `run` keeps conversations: a session file, a store of named ones, or nowhere."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import kvtool
from kvtool.commands.common.text import lazy_console
from kvtool.commands.run.chat import ChatSession
from kvtool.commands.run.pool import ConversationPool
from kvtool.common.store import ConversationConflictError, ConversationStore

err = lazy_console(stderr=True)


def _note(text: str) -> None:
    err.print(f"({text})", markup=False, style="yellow")


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
        self.pool = None if store is None else ConversationPool(ctx, store, new_session, _note)
        self.name = name
        if self.pool is not None:
            self.session = self.pool.open(name)
            if self.session.messages or self.session.cached:
                err.print(f"(conversation '{name}': {self._summary()})", style="dim")
            return
        self.session = new_session(0)
        if session_file is not None and session_file.exists():
            self.session.load_state(session_file)
            err.print(f"(resumed {session_file}: {self._summary()})", style="dim")

    def _summary(self) -> str:
        return f"{len(self.session.messages)} messages, {len(self.session.cached)} tokens"

    def save(self, name: str) -> str:
        if self.pool is not None:
            if name == self.name:
                try:  # another process's save since ours is refused, not overwritten
                    self.pool.save(self.name)
                except ConversationConflictError as e:
                    raise ConversationConflictError(f"{e}; /save NEW keeps this one") from None
            else:
                self.pool.save(self.name, as_name=name)
            return f"saved as '{name}' in the store {self.pool.store.path}"
        path = Path(name).expanduser().resolve()  # a file name, relative to where kvtool runs
        n = self.session.save_state(path)
        return f"saved to {path}: {n:,} bytes; /load {name} or --session {name} resumes it"

    def load(self, name: str) -> str:
        if self.pool is not None:
            known = name in {r.name for r in self.pool.store.list()}
            self.name = self.pool.keep(self.name)
            try:
                self.session, self.name = self.pool.open(name), name
            except BaseException:  # the current one may have been evicted to make room: back to it
                self.session = self.pool.open(self.name)
                raise
            if not known:  # a store's /load switches, so a new name starts a conversation
                return f"no conversation '{name}' in the store: started it empty"
            return f"conversation '{name}': {self._summary()}"
        path = Path(name).expanduser().resolve()
        if not path.exists():
            raise kvtool.StateError(f"no saved conversation at {path}")
        self.session.load_state(path)  # all checked first: a failed load changes nothing
        return f"loaded {path}: {self._summary()}"

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

    def finish(self) -> None:
        if self.pool is not None:
            self.pool.close_all()
            self.pool.store.close()
        elif self.file is not None:
            self.session.save_state(self.file)
