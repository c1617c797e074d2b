"""What memory a model needs (the model declares it, as mlx-lm's make_cache) and what the context
decides (MemoryParams). A spec builds its memory and says what that memory will hold before it
is built: adding a memory kind needs a spec class, no edit in the context, the estimate or the
state code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvtool.kernels.kv_quant import KV_TYPES, KVType
from kvtool.memory.defrag import DefragPolicy
from kvtool.memory.kv_cache import KVCache, KVCacheParams, KVLayerSpec, ShiftFn, breakdown
from kvtool.memory.kv_cells import SWAParams
from kvtool.memory.sizes import MemoryBreakdown
from kvtool.memory.swa_kv_cache import SWAKVCache

if TYPE_CHECKING:
    from kvtool.memory.base import Memory


def pad(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class MemoryParams:
    """The context's choices a memory is built with (from kvtool.ContextParams)."""

    n_ctx_seq: int  # KV cells per stream
    n_seq_max: int
    n_ubatch: int
    kv_unified: bool = False
    swa_full: bool = False
    type_k: KVType = KV_TYPES["f16"]
    type_v: KVType = KV_TYPES["f16"]
    device: str | torch.device = "cpu"
    n_rs_seq: int = 0  # recurrent states kept per sequence for rollback
    defrag: DefragPolicy = field(default_factory=DefragPolicy)  # KV caches only
    attn_rot: bool = True  # llama.cpp's Hadamard rotation around quantized K/V (KV caches only)


class MemorySpec(Protocol):
    def build(self, params: MemoryParams) -> Memory:
        """The memory, allocated."""
        ...

    def memory_breakdown(self, params: MemoryParams) -> MemoryBreakdown:
        """What `build(params)` will hold (its `memory_breakdown()`), without allocating it;
        raises KvtoolError for params the memory refuses."""
        ...


@dataclass(frozen=True)
class KVSpec:
    """Attention layers and the K/V they store; `swa_layers` (with `swa`) use a sliding window;
    `shift` re-rotates cached K rows when positions move (None: positions cannot move)."""

    layers: dict[int, KVLayerSpec]
    shift: ShiftFn | None = None
    swa_layers: frozenset[int] = field(default_factory=frozenset)
    swa: SWAParams | None = None

    def _caches(self, p: MemoryParams) -> list[tuple[dict[int, KVLayerSpec], KVCacheParams]]:
        """The caches to build: one, or a base + sliding-window pair whose window cache holds
        pad256(min(n_ctx_seq, n_swa * (n_seq_max if unified else 1) + n_ubatch)) cells per stream
        (all of n_ctx_seq with swa_full), as llama.cpp sizes it."""

        def params(n_cells: int, swa: SWAParams | None) -> KVCacheParams:
            return KVCacheParams(
                n_cells, p.n_seq_max, p.kv_unified, swa, p.type_k, p.type_v, p.device, p.defrag, p.attn_rot
            )

        if not self.swa_layers:
            return [(self.layers, params(p.n_ctx_seq, None))]
        if self.swa is None:
            raise ValueError("sliding-window layers need SWAParams")
        base = {il: s for il, s in self.layers.items() if il not in self.swa_layers}
        win = {il: s for il, s in self.layers.items() if il in self.swa_layers}
        n_swa_cells = p.n_ctx_seq
        if not p.swa_full:
            want = self.swa.n_swa * (p.n_seq_max if p.kv_unified else 1) + p.n_ubatch
            n_swa_cells = pad(min(p.n_ctx_seq, want))
        return [(base, params(p.n_ctx_seq, None)), (win, params(n_swa_cells, self.swa))]

    def build(self, params: MemoryParams) -> KVCache | SWAKVCache:
        """One KVCache, or a base + sliding-window pair (`_caches`)."""
        caches = [KVCache(layers, kp, self.shift) for layers, kp in self._caches(params)]
        return caches[0] if len(caches) == 1 else SWAKVCache(caches[0], caches[1])

    def memory_breakdown(self, params: MemoryParams) -> MemoryBreakdown:
        caches = [breakdown(layers, kp) for layers, kp in self._caches(params)]
        if len(caches) == 1:
            return caches[0]
        return caches[0].named("base") + caches[1].named("swa")  # SWAKVCache's names
