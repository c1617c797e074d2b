"""Interleaved sliding-window attention memory (llama.cpp's llama_kv_cache_iswa): a base
KVCache for the global layers and a smaller KVCache with a window for the sliding layers."""

from __future__ import annotations

from kvtool.memory.base import Commit, MemoryRefused, SeqAdd, SeqDiv, SeqOp
from kvtool.memory.composite import Composite
from kvtool.memory.kv_cache import KVCache


class SWAKVCache(Composite):
    """Every sequence op goes to both caches, all or nothing; positions are reported by the window
    cache (the base cache holds a superset)."""

    kind = "swa_kv"

    def __init__(self, base: KVCache, swa: KVCache) -> None:
        super().__init__({"base": base, "swa": swa})
        self.base = base
        self.swa = swa

    def can_shift(self) -> bool:
        # Moving positions in a window cache that already forgot older tokens is meaningless
        # unless it holds everything (llama.cpp: both caches of one size).
        return super().can_shift() and self.base.n_cells == self.swa.n_cells

    def plan(self, op: SeqOp) -> Commit:
        if isinstance(op, SeqAdd | SeqDiv) and not self.can_shift():
            raise MemoryRefused("positions cannot move in a sliding-window cache smaller than the context")
        return super().plan(op)
