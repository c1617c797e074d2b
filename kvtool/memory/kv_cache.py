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
from kvtool.checks import POS_END, as_int
from kvtool.errors import KvtoolError
from kvtool.kernels.kv_quant import KV_TYPES, KVType
from kvtool.memory import kv_cache_state
from kvtool.memory.base import (
    Clear,
    Commit,
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
    pos_range,
)
from kvtool.memory.defrag import DefragPolicy, plan_defrag
from kvtool.memory.kv_cache_context import KVCacheContext
from kvtool.memory.kv_cells import KVCells, SWAParams, seq_bit
from kvtool.memory.kv_update import KVUpdateContext
from kvtool.memory.sizes import MemoryBreakdown, PartSize
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
    type_k: KVType = KV_TYPES["f16"]
    type_v: KVType = KV_TYPES["f16"]
    device: str | torch.device = "cpu"
    defrag: DefragPolicy = field(default_factory=DefragPolicy)
    attn_rot: bool = True  # llama.cpp's Hadamard rotation around a quantized K or V (where it applies)

    @property
    def n_stream(self) -> int:
        return 1 if self.unified else self.n_seq_max


def check_types(specs: dict[int, KVLayerSpec], type_k: KVType, type_v: KVType) -> None:
    """Refuses, in llama.cpp's words, a quantized type whose blocks do not tile a head."""
    for s in specs.values():
        for t, n, what in ((type_k, s.head_dim_k, "K"), (type_v, s.head_dim_v, "V")):
            if not t.divides(n):
                raise KvtoolError(
                    f"{what} cache type {t.name} with block size {t.block} does not divide "
                    f"n_embd_head_{what.lower()}={n}"
                )


def rotation(t: KVType, head_dims: set[int], smallest: bool, enabled: bool) -> int:
    """The size of llama.cpp's Hadamard rotation for a cache of type `t` whose layers have these
    head sizes (0: none): only a quantized type, heads of one size that is a multiple of 64; K
    takes the largest power of two dividing it, V 64 (`smallest`; llama-kv-cache.cpp)."""
    if not enabled or not t.quantized or len(head_dims) != 1:
        return 0
    hd = head_dims.pop()
    if hd % 64:
        return 0
    n = 64
    while not smallest and hd % (2 * n) == 0:
        n *= 2
    return n


def breakdown(specs: dict[int, KVLayerSpec], p: KVCacheParams) -> MemoryBreakdown:
    """What a KVCache of these layers and params holds, before it is built."""
    check_types(specs, p.type_k, p.type_v)
    rows = p.n_stream * p.n_cells
    k = rows * sum(s.n_head_kv * p.type_k.row_bytes(s.head_dim_k) for s in specs.values())
    v = rows * sum(s.n_head_kv * p.type_v.row_bytes(s.head_dim_v) for s in specs.values())
    return _sizes(specs, p, k, v, rows * KVCells.CELL_BYTES, (0,) * p.n_stream)


def _sizes(
    specs: dict[int, KVLayerSpec], p: KVCacheParams, k: int, v: int, cells: int, used: tuple[int, ...]
) -> MemoryBreakdown:
    kind = "attention" if p.swa is None else "sliding_window"
    size = PartSize(
        "", kind, p.n_cells, p.n_stream, used, len(specs), k=k, v=v, cells=cells,
        type_k=p.type_k.name, type_v=p.type_v.name,
    )  # fmt: skip
    return MemoryBreakdown((size,), n_kv=p.n_cells if specs else 0)


def _nothing() -> None:
    return None


class KVCache(SeqOps, PartBatches):
    """K/V tensors `[n_stream, n_cells, n_head_kv, head_dim]` per layer, and their cells."""

    kind = "kv"

    def __init__(
        self, specs: dict[int, KVLayerSpec], params: KVCacheParams, shift_fn: ShiftFn | None
    ) -> None:
        check_types(specs, params.type_k, params.type_v)  # before anything is allocated
        self.params = params
        self.specs = specs
        self.n_stream = params.n_stream
        self.n_cells = params.n_cells
        self.cells = [KVCells(params.n_cells) for _ in range(self.n_stream)]
        self.shift_fn = shift_fn
        tk, tv, on = params.type_k, params.type_v, params.attn_rot
        self.rot_k = rotation(tk, {s.head_dim_k for s in specs.values()}, False, on)
        self.rot_v = rotation(tv, {s.head_dim_v for s in specs.values()}, True, on)
        shape = (self.n_stream, params.n_cells)
        dev = params.device
        # a quantized type's head row is its blocks, as bytes
        self.k = {
            il: torch.zeros(*shape, s.n_head_kv, tk.width(s.head_dim_k), dtype=tk.dtype, device=dev)
            for il, s in specs.items()
        }  # [n_stream, n_cells, n_head_kv, head_dim_k (or its blocks' bytes)]
        self.v = {
            il: torch.zeros(*shape, s.n_head_kv, tv.width(s.head_dim_v), dtype=tv.dtype, device=dev)
            for il, s in specs.items()
        }  # [n_stream, n_cells, n_head_kv, head_dim_v (or its blocks' bytes)]
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
        if not 0 <= as_int(seq_id, "a sequence id") < self.params.n_seq_max:
            raise MemoryRefused(f"sequence {seq_id} is out of range (n_seq_max = {self.params.n_seq_max})")

    def _streams_for(self, seq_id: int) -> list[int]:
        return list(range(self.n_stream)) if seq_id < 0 else [self.stream_of(seq_id)]

    def seq_pos_min(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self.cells[self.stream_of(seq_id)].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        self._check_seq(seq_id)
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

    def memory_breakdown(self) -> MemoryBreakdown:
        """The bytes of the K/V tensors allocated and of the cells' bookkeeping, the cells each
        stream uses."""

        def nbytes(ts: dict[int, torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in ts.values())

        cells = sum(c.nbytes() for c in self.cells)
        used = tuple(c.n_used() for c in self.cells)
        return _sizes(self.specs, self.params, nbytes(self.k), nbytes(self.v), cells, used)

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
            cells = self.cells[self.stream_of(seq)]
            moved = cells.pos[cells.has_seq(seq) & (cells.pos >= lo) & (cells.pos < hi)]
            if moved.size and int(moved.max()) + op.delta >= POS_END:
                raise MemoryRefused(f"seq_add: sequence {seq} would pass the last position ({POS_END - 1})")
            return lambda: cells.seq_add(seq, lo, hi, op.delta)
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

    def init_update(self, optimize: bool = False) -> KVUpdateContext | NoUpdate:
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
            return KVUpdateContext(self, plans)
        return NoUpdate()

    # -- state ----------------------------------------------------------------------------------
    def state_write(self, w: StateWriter, seq: int | None) -> None:
        kv_cache_state.write(self, w, seq)

    def state_read(self, r: StateReader, seq: int | None) -> Commit:
        return kv_cache_state.plan_read(self, r, seq)
