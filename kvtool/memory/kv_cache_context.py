"""One planned batch on a KVCache: applies ubatches and hands attention layers their views."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtool.kernels.kq_mask import KQMask
from kvtool.kernels.kv_quant import KV_TYPES, KVType
from kvtool.kernels.visibility import Cells
from kvtool.memory.base import GraphInputs, MemoryStatus
from kvtool.memory.kv_cells import KVCells

if TYPE_CHECKING:
    from kvtool.batch import UBatch
    from kvtool.memory.kv_cache import KVCache


@dataclass(frozen=True)
class KVView:
    """What an attention layer computes with for one ubatch: its cache, where the ubatch's K/V rows
    go, and what each query sees. The layer stores and attends (kvtool.backend.Backend.attend)."""

    k: torch.Tensor  # [n_stream, n_cells, n_head_kv, head_dim_k] the layer's whole K cache (a quantized
    # type: [..., bytes of a head's blocks], uint8)
    v: torch.Tensor  # [n_stream, n_cells, n_head_kv, head_dim_v]
    k_rows: torch.Tensor  # `k` as rows [n_stream * n_cells, n_head_kv * head_dim_k]: where `rows` go
    v_rows: torch.Tensor  # `v` as rows [n_stream * n_cells, n_head_kv * head_dim_v]
    rows: torch.Tensor  # [n_tokens] int64: stream * n_cells + cell of each ubatch row
    streams: slice  # the consecutive streams the ubatch's rows belong to, in row-block order
    n_kv: int  # cells attended per stream (the used span)
    mask: KQMask | None  # [n_stream_ub, n_tokens / n_stream_ub, n_kv] additive: 0 seen, -inf not
    cells: Cells | None = None  # instead of the mask: what it is built from (on CUDA)
    type_k: KVType = KV_TYPES["f16"]  # what k and v hold
    type_v: KVType = KV_TYPES["f16"]
    rot_k: int = 0  # llama.cpp's Hadamard rotation of Q and K before the store (its size; 0: none)
    rot_v: int = 0  # ... of V before the store, and of the attention output back

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [n_stream_ub, n_kv, n_head_kv, head_dim] of the ubatch's streams: views."""
        s, n = self.streams, self.n_kv
        if s.start == 0 and s.stop == self.k.shape[0]:  # every stream (one op per tensor, not two)
            return self.k.narrow(1, 0, n), self.v.narrow(1, 0, n)
        return self.k[s, :n], self.v[s, :n]


# On the cells path the attended span is rounded up to whole blocks of this many cells (as
# llama.cpp pads n_kv): the kernel skips the empty cells' tiles, and a decode step keeps one
# shape for 256 tokens, so its CUDA graph is replayed instead of captured again.
N_KV_PAD = 256


def visibility_from_cells(device: str | torch.device) -> bool:
    """Whether attention on `device` takes the cells' metadata (the CUDA kernel evaluates it per
    tile, so no n_tokens x n_kv mask is built or copied) rather than the dense mask."""
    return torch.device(device).type == "cuda"


@dataclass
class _Undo:
    """What a batch's applies changed, to undo a failed decode: each touched stream's cells as
    they were, and the K/V rows of pre-batch tokens that a ubatch took over (a sliding window
    reuses cells its ubatch no longer sees, though the state before the batch may still need
    them, e.g. to resume at an earlier position)."""

    cells: dict[int, KVCells]
    taken: dict[int, np.ndarray]  # [n_cells] bool per stream: written by this batch
    rows: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]  # (rows, K per layer, V)


class KVCacheContext:
    """Plan of a batch: ubatches and their cell slots. `apply()` writes the current ubatch's
    cells and builds the visibility mask every layer of this cache shares; `rollback()` undoes
    the applies."""

    status = MemoryStatus.SUCCESS

    def __init__(self, cache: KVCache, ubatches: list[UBatch], slots: list[list[np.ndarray]]) -> None:
        self.cache = cache
        self.ubatches = ubatches
        self.slots = slots
        self.i = 0
        self._rows: torch.Tensor | None = None
        self._mask: KQMask | None = None
        self._cells: Cells | None = None
        self._streams = slice(0, 1)
        self._n_kv = 0
        self._from_cells = visibility_from_cells(cache.params.device)
        self._undo = _Undo({}, {}, [])

    @property
    def ubatch(self) -> UBatch:
        return self.ubatches[self.i]

    def next(self) -> bool:
        self.i += 1
        self._rows = self._mask = self._cells = None
        return self.i < len(self.ubatches)

    def apply(self) -> bool:
        """Writes the current ubatch into its cells and builds its attention inputs."""
        cache, ub = self.cache, self.ubatch
        streams = cache.ubatch_streams(ub)
        per = ub.n_tokens // len(streams)
        rows = []
        for b, (s, idx) in enumerate(zip(streams, self.slots[self.i], strict=True)):
            sl = slice(b * per, (b + 1) * per)
            self._save(s, idx)
            cache.cells[s].apply(idx, ub.pos[sl], ub.seq_mask[sl])
            rows.append(s * cache.n_cells + idx)
        assert streams == list(range(streams[0], streams[-1] + 1)), "ubatch streams must be consecutive"
        self._streams = slice(streams[0], streams[-1] + 1)
        self._rows = torch.from_numpy(np.concatenate(rows)).to(cache.params.device)
        self._n_kv = max(cache.cells[s].used_max_p1() for s in streams)
        if self._from_cells:
            self._n_kv = min(cache.n_cells, -(-self._n_kv // N_KV_PAD) * N_KV_PAD)
            self._cells = self._build_cells(ub, streams, per)
        else:
            self._mask = self._build_mask(ub, streams, per)  # every layer of this cache shares it
        return True

    def _save(self, s: int, idx: np.ndarray) -> None:
        """Before cells `idx` of stream `s` are written: the stream's cells at their first
        write in this batch, and the K/V rows of the cells that held a token before the batch
        (once: a cell this batch already took over holds one of its own tokens)."""
        cache, undo = self.cache, self._undo
        if s not in undo.cells:
            undo.cells[s] = cache.cells[s].copy()
            undo.taken[s] = np.zeros(cache.n_cells, dtype=bool)
        held = idx[(undo.cells[s].pos[idx] != KVCells.EMPTY) & ~undo.taken[s][idx]]
        undo.taken[s][idx] = True
        if not len(held):
            return
        r = torch.from_numpy(s * cache.n_cells + held).to(cache.params.device)
        k = [t.index_select(0, r) for t in cache.k_rows.values()]
        v = [t.index_select(0, r) for t in cache.v_rows.values()]
        undo.rows.append((r, k, v))

    def rollback(self) -> None:
        cache = self.cache
        for r, ks, vs in self._undo.rows:
            for t, rows in zip((*cache.k_rows.values(), *cache.v_rows.values()), (*ks, *vs), strict=True):
                t.index_copy_(0, r, rows)
        for s, cells in self._undo.cells.items():
            cache.cells[s].restore(cells)
        self._undo = _Undo({}, {}, [])

    def _build_cells(self, ub: UBatch, streams: list[int], per: int) -> Cells:
        """The metadata `_build_mask` reads, on the cache's device ([n_stream_ub, n_kv] cells,
        [n_stream_ub, per] queries): the kernel applies the same rule."""
        n_kv, swa, dev = self._n_kv, self.cache.params.swa, self.cache.params.device
        pos = np.stack([self.cache.cells[s].pos[:n_kv] for s in streams])
        seq = np.stack([self.cache.cells[s].seq[:n_kv] for s in streams]).view(np.int64)  # same bits
        q_pos = ub.pos.astype(np.int64).reshape(len(streams), per)
        q_seq = ub.seq_id.astype(np.int64).reshape(len(streams), per)
        pos_t, seq_t, qp_t, qs_t = (torch.from_numpy(a).to(dev) for a in (pos, seq, q_pos, q_seq))
        if swa is None:
            return Cells(pos_t, seq_t, qp_t, qs_t)
        return Cells(pos_t, seq_t, qp_t, qs_t, swa.kind, swa.n_swa)

    def _build_mask(self, ub: UBatch, streams: list[int], per: int) -> KQMask:
        """[n_stream_ub, per, n_kv] additive mask: 0 where the query's sequence owns the cell,
        the cell is not in its future, and (sliding window) not too far in its past. Built for
        all streams at once, once per ubatch, on the cache's device."""
        n_kv, swa = self._n_kv, self.cache.params.swa
        cp = np.stack([self.cache.cells[s].pos[:n_kv] for s in streams])[:, None, :]  # [S, 1, n_kv]
        cs = np.stack([self.cache.cells[s].seq[:n_kv] for s in streams])[:, None, :]
        qp = ub.pos.astype(np.int64).reshape(len(streams), per, 1)  # [S, per, 1]
        qs = ub.seq_id.astype(np.uint64).reshape(len(streams), per, 1)
        vis = ((cs >> qs) & np.uint64(1)).astype(bool) & (cp <= qp) & (cp >= 0)
        if swa is not None:
            vis &= ~swa.masked(cp, qp)
        mask = torch.from_numpy(np.where(vis, np.float32(0.0), np.float32(-np.inf)))
        # a query sees at least its own cell, just written; checked here in numpy, not per layer
        return KQMask(mask.to(self.cache.params.device), find_empty=not vis.any(-1).all())

    def graph_inputs(self) -> GraphInputs | None:
        """The applied ubatch's rows and cells (on the cells path; the dense mask is the CPU's,
        where nothing is captured), keyed by its streams and span."""
        if self._rows is None or self._cells is None:
            return None
        c = self._cells
        key = (self._streams.start, self._streams.stop, self._n_kv, c.swa, c.n_swa, c.causal)
        return key, [self._rows, c.pos, c.seq, c.q_pos, c.q_seq]

    def layer_view(self, il: int) -> KVView:
        if self._rows is None or (self._mask is None and self._cells is None):
            raise RuntimeError("apply() the ubatch before computing it")
        c = self.cache
        return KVView(
            c.k[il],
            c.v[il],
            c.k_rows[il],
            c.v_rows[il],
            self._rows,
            self._streams,
            self._n_kv,
            self._mask,
            self._cells,
            c.params.type_k,
            c.params.type_v,
            c.rot_k,
            c.rot_v,
        )
