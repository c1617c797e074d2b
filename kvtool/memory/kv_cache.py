"""The KV cache (llama.cpp's llama_kv_cache): per layer K and V tensors over streams of cells.

unified=True: one stream shared by every sequence; cells carry sequence sets, `seq_cp` is
metadata only. unified=False: one stream per sequence, so attention never spans sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtool.batch import BatchAllocator, DecodeError, UBatch
from kvtool.errors import KvtoolError
from kvtool.memory.base import MemoryStatus, NoUpdate, pos_range
from kvtool.memory.kv_cache_context import KVCacheContext
from kvtool.memory.kv_cells import KVCells, SWAParams, seq_bit

# (layer, K rows [n, n_head_kv, head_dim], position deltas [n]) -> rotated K rows
ShiftFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class KVLayerSpec:
    """The K/V shape one attention layer stores."""

    n_head_kv: int
    head_dim_k: int
    head_dim_v: int


@dataclass(frozen=True)
class KVCacheParams:
    n_cells: int  # per stream
    n_seq_max: int
    unified: bool
    swa: SWAParams | None = None
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"


class KVCache:
    """K/V tensors `[n_stream, n_cells, n_head_kv, head_dim]` per layer, and their cells."""

    def __init__(
        self, layers: dict[int, KVLayerSpec], params: KVCacheParams, shift_fn: ShiftFn | None
    ) -> None:
        self.params = params
        self.layers = layers
        self.n_stream = 1 if params.unified else params.n_seq_max
        self.n_cells = params.n_cells
        self.cells = [KVCells(params.n_cells) for _ in range(self.n_stream)]
        self.shift_fn = shift_fn
        shape = (self.n_stream, params.n_cells)
        self.k = {
            il: torch.zeros(*shape, s.n_head_kv, s.head_dim_k, dtype=params.dtype, device=params.device)
            for il, s in layers.items()
        }
        self.v = {
            il: torch.zeros(*shape, s.n_head_kv, s.head_dim_v, dtype=params.dtype, device=params.device)
            for il, s in layers.items()
        }

    # -- sequences and streams ------------------------------------------------------------------
    def stream_of(self, seq_id: int) -> int:
        return 0 if self.params.unified else seq_id

    def _streams_for(self, seq_id: int) -> list[int]:
        return list(range(self.n_stream)) if seq_id < 0 else [self.stream_of(seq_id)]

    def seq_pos_min(self, seq_id: int) -> int:
        return self.cells[self.stream_of(seq_id)].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.cells[self.stream_of(seq_id)].seq_pos_max(seq_id)

    def n_used(self) -> int:
        return sum(c.n_used() for c in self.cells)

    def clear(self, data: bool) -> None:
        for c in self.cells:
            c.reset()
        if data:
            for t in (*self.k.values(), *self.v.values()):
                t.zero_()

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        lo, hi = pos_range(p0, p1)
        for s in self._streams_for(seq_id):
            self.cells[s].seq_rm(seq_id, lo, hi)
        return True

    def seq_keep(self, seq_id: int) -> None:
        for s, c in enumerate(self.cells):
            if s == self.stream_of(seq_id):
                c.seq_keep(seq_id)
            else:
                c.reset()

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        lo, hi = pos_range(p0, p1)
        if lo != hi:
            self.cells[self.stream_of(seq_id)].seq_add(seq_id, lo, hi, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        lo, hi = pos_range(p0, p1)
        if lo != hi:
            self.cells[self.stream_of(seq_id)].seq_div(seq_id, lo, hi, d)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """dst gets src's tokens in [p0, p1). In one stream the cells are shared; across
        streams the cells and their K/V rows are copied (a whole copy replaces dst's stream)."""
        if src == dst:
            return
        lo, hi = pos_range(p0, p1)
        s0, s1 = self.stream_of(src), self.stream_of(dst)
        c0, c1 = self.cells[s0], self.cells[s1]
        hit = c0.has_seq(src) & (c0.pos >= lo) & (c0.pos < hi)
        if s0 == s1:
            c0.seq[hit] |= seq_bit(dst)
            return
        src_idx = np.flatnonzero(hit)
        whole = p0 < 0 and p1 < 0
        if whole:
            c1.reset()
            c1.head = c0.head  # the copy continues where the source would (as llama.cpp)
        if (c1.pos[src_idx] == -1).all():
            dst_idx = src_idx
        else:
            found = c1.find_slot(len(src_idx))
            if found is None:
                raise KvtoolError(f"seq_cp: stream of sequence {dst} has no room for {len(src_idx)} cells")
            dst_idx = np.sort(found)
        c1.pos[dst_idx] = c0.pos[src_idx]
        c1.shift[dst_idx] = c0.shift[src_idx]
        c1.seq[dst_idx] = seq_bit(dst)
        c1.has_shift = c1.has_shift or bool(c0.shift[src_idx].any())
        si = torch.from_numpy(src_idx).to(self.params.device)
        di = torch.from_numpy(dst_idx).to(self.params.device)
        for t in (*self.k.values(), *self.v.values()):
            t[s1].index_copy_(0, di, t[s0].index_select(0, si))

    def can_shift(self) -> bool:
        return self.shift_fn is not None

    def first_needed(self, pos: int) -> int:
        """The oldest position a token at `pos` attends to (the window's start, or 0)."""
        swa = self.params.swa
        return 0 if swa is None or swa.kind != "standard" else max(0, pos - swa.n_swa + 1)

    # -- batches --------------------------------------------------------------------------------
    def split(self, alloc: BatchAllocator, n_ubatch: int) -> list[UBatch]:
        """unified: tokens in batch order; split: equal tokens per consecutive sequences."""
        out: list[UBatch] = []
        while True:
            ub = alloc.split_simple(n_ubatch) if self.params.unified else alloc.split_equal(n_ubatch, True)
            if ub is None:
                return out
            out.append(ub)

    def _ubatch_streams(self, ub: UBatch) -> list[int]:
        return [0] if self.params.unified else [self.stream_of(s) for s in ub.seq_id_unq]

    def prepare(self, ubatches: list[UBatch]) -> list[list[np.ndarray]] | None:
        """Simulates placing every ubatch (on copies of the cells): the slots, or None if one does not fit."""
        cells = [c.copy() for c in self.cells]
        slots: list[list[np.ndarray]] = []
        for ub in ubatches:
            streams = self._ubatch_streams(ub)
            per = len(ub.token) // len(streams)
            ub_slots = []
            for b, s in enumerate(streams):
                rows = slice(b * per, (b + 1) * per)
                idx = cells[s].find_slot(per, self.params.swa)
                if idx is None:
                    return None
                cells[s].apply(idx, ub.pos[rows], ub.seq_mask[rows])
                ub_slots.append(idx)
            slots.append(ub_slots)
        return slots

    def init_batch(self, alloc: BatchAllocator, n_ubatch: int, embd_all: bool = False) -> KVCacheContext:
        ubatches = self.split(alloc, n_ubatch)
        slots = self.prepare(ubatches)
        if slots is None:
            return KVCacheContext(self, [], [], MemoryStatus.FAILED_PREPARE)
        return KVCacheContext(self, ubatches, slots, MemoryStatus.SUCCESS)

    def init_full(self) -> KVCacheContext:
        return KVCacheContext(self, [], [], MemoryStatus.SUCCESS)

    def init_update(self, optimize: bool = False) -> KVShiftContext | NoUpdate:
        if any(c.has_shift for c in self.cells):
            if self.shift_fn is None:
                raise DecodeError("this model's memory cannot shift positions", -1)
            return KVShiftContext(self)
        return NoUpdate()


class KVShiftContext:
    """Applies pending position shifts: K rows are re-rotated by their deltas."""

    status = MemoryStatus.SUCCESS

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def next(self) -> bool:
        return False

    def apply(self) -> bool:
        cache = self.cache
        assert cache.shift_fn is not None
        for s, cells in enumerate(cache.cells):
            if not cells.has_shift:
                continue
            shift = cells.take_shift()
            idx = np.flatnonzero((shift != 0) & cells.used())
            if idx.size == 0:
                continue
            ti = torch.from_numpy(idx).to(cache.params.device)
            delta = torch.from_numpy(shift[idx]).to(cache.params.device)
            for il, k in cache.k.items():
                rows = k[s].index_select(0, ti)
                k[s].index_copy_(0, ti, cache.shift_fn(il, rows.float(), delta).to(k.dtype))
        return True
