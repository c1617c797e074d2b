"""Interleaved sliding-window attention memory (llama.cpp's llama_kv_cache_iswa): a base
KVCache for the global layers and a smaller KVCache with a window for the sliding layers."""

from __future__ import annotations

import torch

from kvtool.batch import BatchAllocator, UBatch
from kvtool.memory.base import MemoryStatus, NoUpdate
from kvtool.memory.kv_cache import KVCache
from kvtool.memory.kv_cache_context import KVCacheContext


class SWAKVCache:
    """Every sequence op goes to both caches; positions are reported by the window cache."""

    def __init__(self, base: KVCache, swa: KVCache) -> None:
        self.base = base
        self.swa = swa
        self.params = base.params

    @property
    def parts(self) -> tuple[KVCache, KVCache]:
        return (self.base, self.swa)

    def clear(self, data: bool) -> None:
        for c in self.parts:
            c.clear(data)

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return all([c.seq_rm(seq_id, p0, p1) for c in self.parts])

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        for c in self.parts:
            c.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        for c in self.parts:
            c.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        for c in self.parts:
            c.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        for c in self.parts:
            c.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.swa.seq_pos_min(seq_id)  # the base cache holds a superset

    def seq_pos_max(self, seq_id: int) -> int:
        return self.swa.seq_pos_max(seq_id)

    def n_used(self) -> int:
        return self.base.n_used()

    def first_needed(self, pos: int) -> int:
        return self.swa.first_needed(pos)  # the global layers keep every position

    def can_shift(self) -> bool:
        return self.base.can_shift() and self.swa.can_shift() and self.base.n_cells == self.swa.n_cells

    def init_batch(self, alloc: BatchAllocator, n_ubatch: int, embd_all: bool = False) -> SWAKVCacheContext:
        ubatches = self.base.split(alloc, n_ubatch)
        slots_base = self.base.prepare(ubatches)
        slots_swa = self.swa.prepare(ubatches)
        if slots_base is None or slots_swa is None:
            return SWAKVCacheContext([], None, None, MemoryStatus.FAILED_PREPARE)
        return SWAKVCacheContext(
            ubatches,
            KVCacheContext(self.base, ubatches, slots_base, MemoryStatus.SUCCESS),
            KVCacheContext(self.swa, ubatches, slots_swa, MemoryStatus.SUCCESS),
            MemoryStatus.SUCCESS,
        )

    def init_full(self) -> SWAKVCacheContext:
        return SWAKVCacheContext([], self.base.init_full(), self.swa.init_full(), MemoryStatus.SUCCESS)

    def init_update(self, optimize: bool = False) -> _Both | NoUpdate:
        ups = [c.init_update(optimize) for c in self.parts]
        if all(u.status == MemoryStatus.NO_UPDATE for u in ups):
            return NoUpdate()
        return _Both(ups)


class _Both:
    """An update of both parts."""

    status = MemoryStatus.SUCCESS

    def __init__(self, ups: list) -> None:  # type: ignore[type-arg]
        self.ups = ups

    def next(self) -> bool:
        return False

    def apply(self) -> bool:
        return all([u.apply() for u in self.ups])


class SWAKVCacheContext:
    """Routes each attention layer to the cache that holds it."""

    def __init__(
        self,
        ubatches: list[UBatch],
        base: KVCacheContext | None,
        swa: KVCacheContext | None,
        status: MemoryStatus,
    ) -> None:
        self.ubatches = ubatches
        self.base_ctx = base
        self.swa_ctx = swa
        self.status = status

    @property
    def ubatch(self) -> UBatch:
        assert self.base_ctx is not None
        return self.base_ctx.ubatch

    def next(self) -> bool:
        assert self.base_ctx is not None and self.swa_ctx is not None
        self.swa_ctx.next()
        return self.base_ctx.next()

    def apply(self) -> bool:
        assert self.base_ctx is not None and self.swa_ctx is not None
        return self.base_ctx.apply() and self.swa_ctx.apply()

    def attend(
        self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        assert self.base_ctx is not None and self.swa_ctx is not None
        ctx = self.swa_ctx if il in self.swa_ctx.cache.layers else self.base_ctx
        return ctx.attend(il, q, k, v, scale)
