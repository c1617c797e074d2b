"""The KV cache (llama.cpp's llama_kv_cache): per layer K and V tensors over streams of cells.

unified=True: one stream shared by every sequence; cells carry sequence sets, `seq_cp` is
metadata only. unified=False: one stream per sequence, so attention never spans sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtool.batch import Split, UBatch
from kvtool.memory import kv_cache_state
from kvtool.memory.base import (
    Clear,
    Commit,
    MemoryBreakdown,
    MemoryRefused,
    NoUpdate,
    PartBatches,
    SeqAdd,
    SeqCp,
    SeqDiv,
    SeqKeep,
    SeqOp,
    SeqOps,
    SeqRm,
    UpdateContext,
    pos_range,
)
from kvtool.memory.defrag import DefragPlan, DefragPolicy, apply_defrag, plan_defrag
from kvtool.memory.kv_cache_context import KVCacheContext
from kvtool.memory.kv_cells import KVCells, SWAParams, seq_bit
from kvtool.state.io import StateReader, StateWriter

# (layer, K rows [n, n_head_kv, head_dim] in float32, position deltas [n]) -> rotated K rows
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
    type_k: torch.dtype = torch.float32
    type_v: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    defrag: DefragPolicy = field(default_factory=DefragPolicy)


def _nothing() -> None:
    return None


class KVCache(SeqOps, PartBatches):
    """K/V tensors `[n_stream, n_cells, n_head_kv, head_dim]` per layer, and their cells."""

    kind = "kv"

    def __init__(
        self, specs: dict[int, KVLayerSpec], params: KVCacheParams, shift_fn: ShiftFn | None
    ) -> None:
        self.params = params
        self.specs = specs
        self.n_stream = 1 if params.unified else params.n_seq_max
        self.n_cells = params.n_cells
        self.cells = [KVCells(params.n_cells) for _ in range(self.n_stream)]
        self.shift_fn = shift_fn
        shape = (self.n_stream, params.n_cells)
        dev = params.device
        self.k = {
            il: torch.zeros(*shape, s.n_head_kv, s.head_dim_k, dtype=params.type_k, device=dev)
            for il, s in specs.items()
        }  # [n_stream, n_cells, n_head_kv, head_dim_k]
        self.v = {
            il: torch.zeros(*shape, s.n_head_kv, s.head_dim_v, dtype=params.type_v, device=dev)
            for il, s in specs.items()
        }  # [n_stream, n_cells, n_head_kv, head_dim_v]
        # the same tensors as rows [n_stream * n_cells, n_head_kv * head_dim], where a ubatch's
        # K/V rows are stored (views made once, not per layer and ubatch)
        self.k_rows = {il: t.view(-1, t.shape[2] * t.shape[3]) for il, t in self.k.items()}
        self.v_rows = {il: t.view(-1, t.shape[2] * t.shape[3]) for il, t in self.v.items()}

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.specs)

    @property
    def split(self) -> Split:
        """unified: tokens in batch order; split: equal tokens per consecutive sequences."""
        return Split.SIMPLE if self.params.unified else Split.EQUAL_SEQUENTIAL

    # -- sequences and streams ------------------------------------------------------------------
    def stream_of(self, seq_id: int) -> int:
        return 0 if self.params.unified else seq_id

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.params.n_seq_max:
            raise MemoryRefused(f"sequence {seq_id} is out of range (n_seq_max = {self.params.n_seq_max})")

    def _streams_for(self, seq_id: int) -> list[int]:
        return list(range(self.n_stream)) if seq_id < 0 else [self.stream_of(seq_id)]

    def seq_pos_min(self, seq_id: int) -> int:
        return self.cells[self.stream_of(seq_id)].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.cells[self.stream_of(seq_id)].seq_pos_max(seq_id)

    def seq_can_resume(self, seq_id: int, pos: int) -> bool:
        """A token at `pos` attends back to the window's start (or 0): those cells must be held."""
        if pos == 0:
            return True
        swa = self.params.swa
        first = 0 if swa is None or swa.kind != "standard" else max(0, pos - swa.n_swa + 1)
        return 0 <= self.seq_pos_min(seq_id) <= first

    def n_used(self) -> int:
        return sum(c.n_used() for c in self.cells)

    def can_shift(self) -> bool:
        return self.shift_fn is not None

    def breakdown(self) -> list[MemoryBreakdown]:
        nbytes = sum(t.nbytes for ts in (self.k, self.v) for t in ts.values())
        kind = "attention" if self.params.swa is None else "sliding_window"
        return [MemoryBreakdown("", kind, nbytes, self.n_cells, tuple(c.n_used() for c in self.cells))]

    # -- sequence operations: planned, then committed --------------------------------------------
    def plan(self, op: SeqOp) -> Commit:
        if isinstance(op, Clear):
            return lambda: self._clear(op.data)
        if isinstance(op, SeqCp):
            return self._plan_cp(op)
        seq = op.seq_id
        if seq >= 0 or not isinstance(op, SeqRm):
            self._check_seq(seq)
        if isinstance(op, SeqRm):
            lo, hi = pos_range(op.p0, op.p1)
            streams = self._streams_for(seq)

            def rm() -> None:
                for s in streams:
                    self.cells[s].seq_rm(seq, lo, hi)

            return rm
        if isinstance(op, SeqKeep):
            return lambda: self._keep(seq)
        lo, hi = pos_range(op.p0, op.p1)
        if isinstance(op, SeqAdd):
            if lo == hi or op.delta == 0:
                return _nothing
            self._check_shift()
            return lambda: self.cells[self.stream_of(seq)].seq_add(seq, lo, hi, op.delta)
        if isinstance(op, SeqDiv):
            if op.d < 1:
                raise MemoryRefused(f"seq_div needs a divisor >= 1, got {op.d}")
            if lo == hi or op.d == 1:
                return _nothing
            self._check_shift()
            return lambda: self.cells[self.stream_of(seq)].seq_div(seq, lo, hi, op.d)
        raise TypeError(f"unknown memory operation {op!r}")

    def _check_shift(self) -> None:
        if self.shift_fn is None:
            raise MemoryRefused("positions cannot move in this memory (the model has no position shift)")

    def _clear(self, data: bool) -> None:
        for c in self.cells:
            c.reset()
        if data:
            for t in (*self.k.values(), *self.v.values()):
                t.zero_()

    def _keep(self, seq_id: int) -> None:
        for s, c in enumerate(self.cells):
            if s == self.stream_of(seq_id):
                c.seq_keep(seq_id)
            else:
                c.reset()

    def _plan_cp(self, op: SeqCp) -> Commit:
        """dst gets src's tokens in [p0, p1). In one stream the cells are shared; across
        streams the cells and their K/V rows are copied (a whole copy replaces dst's stream and
        continues from the source's head, as llama.cpp)."""
        src, dst = op.src, op.dst
        self._check_seq(src)
        self._check_seq(dst)
        if src == dst:
            return _nothing
        lo, hi = pos_range(op.p0, op.p1)
        s0, s1 = self.stream_of(src), self.stream_of(dst)
        c0 = self.cells[s0]
        hit = c0.has_seq(src) & (c0.pos >= lo) & (c0.pos < hi)
        if s0 == s1:

            def share() -> None:
                c0.seq[hit] |= seq_bit(dst)

            return share
        src_idx = np.flatnonzero(hit)
        whole = op.p0 < 0 and op.p1 < 0
        target = KVCells(self.n_cells) if whole else self.cells[s1]
        if (target.pos[src_idx] == -1).all():
            dst_idx = src_idx
        else:
            found = target.find_slot(len(src_idx))
            if found is None:
                raise MemoryRefused(
                    f"seq_cp: the stream of sequence {dst} has no room for {len(src_idx)} cells"
                )
            dst_idx = np.sort(found)

        def copy() -> None:
            c1 = self.cells[s1]
            if whole:
                c1.reset()
                c1.head = c0.head
            c1.pos[dst_idx] = c0.pos[src_idx]
            c1.shift[dst_idx] = c0.shift[src_idx]
            c1.seq[dst_idx] = seq_bit(dst)
            c1.has_shift = c1.has_shift or bool(c0.shift[src_idx].any())
            si = torch.from_numpy(src_idx).to(self.params.device)
            di = torch.from_numpy(dst_idx).to(self.params.device)
            for t in (*self.k.values(), *self.v.values()):
                t[s1].index_copy_(0, di, t[s0].index_select(0, si))

        return copy

    # -- batches --------------------------------------------------------------------------------
    def ubatch_streams(self, ub: UBatch) -> list[int]:
        return [0] if self.params.unified else [self.stream_of(s) for s in ub.seq_id_unq]

    def prepare(self, ubatches: list[UBatch]) -> list[list[np.ndarray]] | None:
        """Simulates placing every ubatch (on copies of the cells): the slots, or None if one does not fit.
        Only the streams the ubatches touch are copied; a single ubatch (a decode step) only reads
        the cells, so nothing is copied."""
        if len(ubatches) == 1:
            return self._prepare_one(ubatches[0])
        cells: dict[int, KVCells] = {}
        slots: list[list[np.ndarray]] = []
        for ub in ubatches:
            streams = self.ubatch_streams(ub)
            per = len(ub.token) // len(streams)
            ub_slots = []
            for b, s in enumerate(streams):
                rows = slice(b * per, (b + 1) * per)
                if s not in cells:
                    cells[s] = self.cells[s].copy()
                idx = cells[s].find_slot(per, self.params.swa, self.params.defrag.contiguous)
                if idx is None:
                    return None
                cells[s].apply(idx, ub.pos[rows], ub.seq_mask[rows])
                ub_slots.append(idx)
            slots.append(ub_slots)
        return slots

    def _prepare_one(self, ub: UBatch) -> list[list[np.ndarray]] | None:
        streams = self.ubatch_streams(ub)
        per = len(ub.token) // len(streams)
        ub_slots = []
        for s in streams:  # find_slot does not mutate: no later ubatch needs to see the placement
            idx = self.cells[s].find_slot(per, self.params.swa, self.params.defrag.contiguous)
            if idx is None:
                return None
            ub_slots.append(idx)
        return [ub_slots]

    def context(self, ubatches: list[UBatch], plan: object) -> KVCacheContext:
        assert isinstance(plan, list)
        return KVCacheContext(self, ubatches, plan)

    def init_update(self, optimize: bool = False) -> KVShiftContext | NoUpdate:
        """Pending shifts, and the compaction of every stream the defrag policy picks (every
        stream with holes when `optimize`, which on-fail asks for after a failed batch)."""
        pol = self.params.defrag
        plans = {}
        for s, c in enumerate(self.cells):
            if optimize or pol.wants(c):
                plan = plan_defrag(c, pol.max_moves)
                if plan.n_moves:
                    plans[s] = plan
        if plans or any(c.has_shift for c in self.cells):
            return KVShiftContext(self, plans)
        return NoUpdate()

    # -- state ----------------------------------------------------------------------------------
    def state_write(self, w: StateWriter, seq: int | None) -> None:
        kv_cache_state.write(self, w, seq)

    def state_read(self, r: StateReader, seq: int | None) -> Commit:
        return kv_cache_state.plan_read(self, r, seq)


class KVShiftContext(UpdateContext):
    """Applies pending position shifts (K rows re-rotated by their deltas), then the planned
    compactions: each pass copies its blocks' K and V rows in every layer, and the cells'
    metadata moves with them."""

    def __init__(self, cache: KVCache, defrag: dict[int, DefragPlan] | None = None) -> None:
        self.cache = cache
        self.defrag = defrag or {}

    def apply(self) -> bool:
        self._shift()
        cache = self.cache
        dev = cache.params.device
        for s, plan in self.defrag.items():
            for moves in plan.passes:
                lens = moves[:, 2]
                step = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
                si = torch.from_numpy(np.repeat(moves[:, 0], lens) + step).to(dev)
                di = torch.from_numpy(np.repeat(moves[:, 1], lens) + step).to(dev)
                # the planner never writes a cell that any move reads: one gather + scatter
                for t in (*cache.k.values(), *cache.v.values()):
                    t[s].index_copy_(0, di, t[s].index_select(0, si))
            apply_defrag(cache.cells[s], plan)
        return True

    def _shift(self) -> None:
        cache = self.cache
        for s, cells in enumerate(cache.cells):
            if not cells.has_shift:
                continue
            assert cache.shift_fn is not None  # plan() refuses shifts without one
            shift = cells.take_shift()
            idx = np.flatnonzero((shift != 0) & cells.used())
            if idx.size == 0:
                continue
            ti = torch.from_numpy(idx).to(cache.params.device)
            delta = torch.from_numpy(shift[idx]).to(cache.params.device)
            for il, k in cache.k.items():
                rows = k[s].index_select(0, ti)
                k[s].index_copy_(0, ti, cache.shift_fn(il, rows.float(), delta).to(k.dtype))
