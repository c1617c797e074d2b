"""Many named conversations on one loaded model, kept in a ConversationStore.

An open conversation holds one sequence of the context's memory. When every sequence is taken,
opening another one saves the least recently used to the store and frees its cells, so only
the active conversations cost cache cells; the others are rows in SQLite."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import kvtool
from kvtool.commands.run.chat import ChatSession


class ConversationPool:
    """Opens, switches, saves and evicts named conversations (one sequence each)."""

    def __init__(
        self, ctx: kvtool.Context, store: kvtool.ConversationStore, new_session: Callable[[int], ChatSession]
    ) -> None:
        """`new_session(seq)` makes an empty ChatSession on sequence `seq` of `ctx`."""
        self.ctx = ctx
        self.store = store
        self._new = new_session
        self._open: OrderedDict[str, ChatSession] = OrderedDict()  # least recently used first

    @property
    def active(self) -> list[str]:
        """Open conversations, least recently used first."""
        return list(self._open)

    def open(self, name: str) -> ChatSession:
        """The conversation `name`: already open, loaded from the store, or new and empty."""
        if not name:
            raise kvtool.StateError("a conversation needs a name")
        if name in self._open:
            self._open.move_to_end(name)
            return self._open[name]
        data = self.store.load(name)
        session = self._new(self._free_seq())
        if data is not None:
            session.restore_data(data)  # validated first: on failure the sequence stays empty
        self._open[name] = session
        return session

    def _free_seq(self) -> int:
        taken = {s.seq for s in self._open.values()}
        free = [s for s in range(self.ctx.params.n_seq_max) if s not in taken]
        if free:
            return free[0]
        lru = next(iter(self._open))
        seq = self._open[lru].seq
        self.close(lru)
        return seq

    def save(self, name: str, as_name: str | None = None) -> None:
        """Stores open conversation `name` (under `as_name`, a copy, if given): one transaction."""
        s = self._open[name]
        model = self.ctx.model
        self.store.save(as_name or name, s.state_data(), s.cached, s.messages, model.name, model.fingerprint)

    def close(self, name: str, save: bool = True) -> None:
        """Saves (by default) and frees the cells of an open conversation."""
        if save:
            self.save(name)
        session = self._open.pop(name)
        self.ctx.memory.seq_rm(session.seq, -1, -1)

    def close_all(self, save: bool = True) -> None:
        for name in list(self._open):
            self.close(name, save)
