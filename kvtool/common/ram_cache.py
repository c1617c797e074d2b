"""The host-RAM prompt cache (llama-server's --cache-ram): when a slot is about to drop a prompt
it holds (another conversation takes the slot, or a full unified cache takes its cells back),
the slot's state (kvtool.common.slot_state: its sequence, tokens and checkpoints) is kept here;
a later request whose prompt shares a longer prefix with an entry than with what its slot holds
gets the entry's state back. Bounded in bytes, least recently used first out; what falls out goes
to `on_evict` (the disk tier). A PrefixSource of the scheduler, on its thread only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import kvtool
from kvtool.common import slot_state
from kvtool.common.prefix import common_prefix

if TYPE_CHECKING:
    from kvtool.common.slots import Slot

MIN_KEEP = 0.25  # the share of an entry's tokens a prompt must share with it (llama-server's f_keep)


@dataclass(frozen=True)
class Entry:
    """A slot's state and the tokens its sequence held."""

    tokens: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass
class TierStats:
    """What a cache tier did since the server started."""

    n_saved: int = 0  # entries stored
    n_hits: int = 0  # entries restored into a slot
    n_evicted: int = 0  # entries dropped for room (to the next tier, if any)
    n_refused: int = 0  # entries not stored: larger than the whole budget
    n_failed: int = 0  # entries that could not be restored (no room in the memory, a bad file)


class RamCache:
    """Slot states in host RAM, at most `max_bytes` of them (-1: no limit)."""

    name = "ram"
    shared = False

    def __init__(self, max_bytes: int, on_evict: Callable[[Entry], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # least recent first
        self.nbytes = 0
        self.stats = TierStats()

    # -- PrefixSource ----------------------------------------------------------------------------
    def offer(self, ctx: kvtool.Context, slot: Slot) -> None:
        tokens = tuple(slot.held)
        if not tokens:
            return
        for key in self.entries:
            if key[: len(tokens)] == tokens:  # an entry holds all of it already
                self.entries.move_to_end(key)
                return
        self.put(Entry(tokens, slot_state.encode(ctx, slot)))

    def restore(self, ctx: kvtool.Context, slot: Slot, tokens: Sequence[int], n_have: int) -> int:
        entry, n = self.best(tokens)
        if entry is None or n <= n_have:
            return n_have
        try:
            slot_state.restore(ctx, slot, entry.data)
        except kvtool.StateError:
            self.stats.n_failed += 1
            return n_have
        self.entries.move_to_end(entry.tokens)
        self.stats.n_hits += 1
        return n

    # -- the store -------------------------------------------------------------------------------
    def best(self, tokens: Sequence[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens` (at most all but the last token:
        its logits are needed), and that length. As llama-server's prompt cache, an entry that
        would keep under a quarter of its tokens is passed over (its state is not worth loading
        for that little)."""
        cap = len(tokens) - 1
        best, n_best = None, 0
        for e in self.entries.values():
            n = min(common_prefix(e.tokens, tokens), cap)
            if n > n_best and n >= MIN_KEEP * len(e.tokens):
                best, n_best = e, n
        return best, n_best

    def put(self, entry: Entry) -> None:
        """Stores an entry; entries whose tokens it extends are dropped, the least recently used
        ones go (to `on_evict`) until the budget holds."""
        if 0 <= self.max_bytes < entry.nbytes:
            self.stats.n_refused += 1
            if self.on_evict is not None:
                self.on_evict(entry)
            return
        for key in [k for k in self.entries if entry.tokens[: len(k)] == k]:
            self._drop(key)
        self.entries[entry.tokens] = entry
        self.nbytes += entry.nbytes
        self.stats.n_saved += 1
        while 0 <= self.max_bytes < self.nbytes:
            old = self._drop(next(iter(self.entries)))
            self.stats.n_evicted += 1
            if self.on_evict is not None:
                self.on_evict(old)

    def flush(self) -> None:
        """Hands every entry to `on_evict`, least recent first (at shutdown)."""
        if self.on_evict is not None:
            for e in list(self.entries.values()):
                self.on_evict(e)

    def _drop(self, key: tuple[int, ...]) -> Entry:
        e = self.entries.pop(key)
        self.nbytes -= e.nbytes
        return e
