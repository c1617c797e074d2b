"""Many named conversations on one loaded model, kept in a ConversationStore.

An open conversation holds one sequence of the context's memory. When every sequence is taken,
opening another one saves the least recently used to the store and frees its cells, so only
the active conversations cost cache cells; the others are rows in SQLite.

Two processes may open the same conversation: each save names the row's generation it
loaded, so the second writer is told instead of silently replacing the first one's turns.
A save the user did not ask for (switching, eviction, exit) then keeps the conversation
under a new name (`NAME~2`) and says so: no turn is lost either way."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import kvtool
from kvtool.commands.run.chat import ChatSession, chat_section
from kvtool.common.store import ConversationConflictError, ConversationStore


class ConversationPool:
    """Opens, switches, saves and evicts named conversations (one sequence each)."""

    def __init__(
        self,
        ctx: kvtool.Context,
        store: ConversationStore,
        new_session: Callable[[int], ChatSession],
        notify: Callable[[str], None] | None = None,
    ) -> None:
        """`new_session(seq)` makes an empty ChatSession on sequence `seq` of `ctx`; `notify`
        hears where a conversation went when another process had saved over its name."""
        self.ctx = ctx
        self.store = store
        self._new = new_session
        self._notify = notify
        self._open: OrderedDict[str, ChatSession] = OrderedDict()  # least recently used first
        self._generation: dict[str, int] = {}  # the stored row's generation each one was loaded at

    @property
    def active(self) -> list[str]:
        """Open conversations, least recently used first."""
        return list(self._open)

    def session(self, name: str) -> ChatSession:
        """Open conversation `name` (KeyError if it is not open)."""
        return self._open[name]

    def open(self, name: str) -> ChatSession:
        """The conversation `name`: already open, loaded from the store, or new and empty.
        A stored state that cannot be restored is a StateError and nothing has changed."""
        if not name:
            raise kvtool.StateError("a conversation needs a name")
        if name in self._open:
            self._open.move_to_end(name)
            return self._open[name]
        held = self.store.load_generation(name)
        if held is not None:  # a row that holds no conversation is refused before any eviction
            chat_section(kvtool.inspect_state(held[0]))
        session = self._new(self._free_seq())
        if held is not None:
            session.restore_data(held[0])  # validated first: on failure the sequence stays empty
        self._open[name] = session
        self._generation[name] = 0 if held is None else held[1]
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

    def save(self, name: str, as_name: str | None = None) -> str:
        """Stores open conversation `name` (under `as_name`, a copy, if given): one transaction.
        Returns the name it was stored under. When another process saved `name` since it was
        loaded, a ConversationConflictError leaves the store as it was."""
        args = self._row(name)
        if as_name is not None and as_name != name:
            if as_name in self._open:
                raise kvtool.StateError(
                    f"conversation '{as_name}' is open here: /load {as_name} switches to it"
                )
            self.store.save(as_name, *args)
            return as_name
        self._generation[name] = self.store.save(name, *args, generation=self._generation[name])
        return name

    def _row(self, name: str) -> tuple[bytes, list[int], list[dict[str, str]], str, str]:
        s, model = self._open[name], self.ctx.model
        return s.state_data(), s.cached, s.messages, model.name, model.fingerprint

    def keep(self, name: str) -> str:
        """Saves open conversation `name` when the user did not ask to (switch, eviction, exit):
        if another process saved over it, under the first free name `name~k`, which the open
        conversation takes. Returns the name it is stored under."""
        try:
            return self.save(name)
        except ConversationConflictError:
            pass
        k = 2
        while True:
            fork = f"{name}~{k}"
            if fork not in self._open:
                try:
                    self._generation[fork] = self.store.save(fork, *self._row(name), generation=0)
                    break
                except ConversationConflictError:
                    pass
            k += 1
        self._open[fork] = self._open.pop(name)
        del self._generation[name]
        if self._notify is not None:
            self._notify(
                f"conversation '{name}' was saved by another process meanwhile: this one is kept as '{fork}'"
            )
        return fork

    def close(self, name: str, save: bool = True) -> str:
        """Saves (by default; see `keep`) and frees the cells of an open conversation; returns
        the name it is stored under."""
        if save:
            name = self.keep(name)
        session = self._open.pop(name)
        self._generation.pop(name, None)
        self.ctx.memory.seq_rm(session.seq, -1, -1)
        return name

    def close_all(self, save: bool = True) -> None:
        for name in list(self._open):
            self.close(name, save)
