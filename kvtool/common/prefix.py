"""Where a request's prompt prefix can come from besides its own slot. The scheduler asks each
`PrefixSource` in turn when a slot starts a request (`restore`) and tells them when a slot is
about to drop what it holds (`offer`): a shared system prompt is one source; the cache tiers of a
server (kvtool.common.ram_cache) plug in here the same way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import kvtool

if TYPE_CHECKING:
    from kvtool.common.slots import Slot


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class PrefixSource(Protocol):
    """A place that can make a sequence hold a prefix of a prompt."""

    @property
    def name(self) -> str:
        """What responses and the ledger call it ("shared", "ram", "disk"...)."""
        ...

    @property
    def shared(self) -> bool:
        """A prefix every request may take, cache_prompt or not (a slot goes back to it after a
        request without cache_prompt); else a cache only cache_prompt requests consult."""
        ...

    def restore(self, ctx: kvtool.Context, slot: Slot, tokens: Sequence[int], n_have: int) -> int:
        """Makes the slot's sequence hold a prefix of `tokens` longer than its `n_have` tokens
        (and the slot's checkpoints those that came with it) and returns the length they share;
        returns `n_have` and leaves the slot as it was when it has nothing longer."""
        ...

    def offer(self, ctx: kvtool.Context, slot: Slot) -> None:
        """The idle slot's held tokens are about to be cut back or dropped: a cache may keep
        its state."""
        ...


class SharedPrefix:
    """A prefix decoded once into a sequence of its own and copied (seq_cp) into any slot whose
    prompt starts with it: llama-parallel's -pps system prompt."""

    name = "shared"
    shared = True

    def __init__(self, ctx: kvtool.Context, seq: int, tokens: Sequence[int]) -> None:
        self.seq = seq
        self.tokens = list(tokens)
        if self.tokens:
            kvtool.decode_tokens(ctx, self.tokens, seq, 0)

    def restore(self, ctx: kvtool.Context, slot: Slot, tokens: Sequence[int], n_have: int) -> int:
        n = len(self.tokens)
        if n <= n_have or list(tokens[:n]) != self.tokens:
            return n_have
        ctx.memory.seq_rm(slot.seq, -1, -1)
        ctx.memory.seq_cp(self.seq, slot.seq, -1, -1)
        return n

    def offer(self, ctx: kvtool.Context, slot: Slot) -> None:
        return None
