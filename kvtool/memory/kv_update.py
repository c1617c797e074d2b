"""A KVCache's pending work (llama.cpp's llama_kv_cache::update): K rows re-rotated by their
position shifts, then the planned compactions."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtool.kernels.hadamard import fwht
from kvtool.kernels.kv_quant import dequantize, quantize
from kvtool.memory.base import UpdateContext
from kvtool.memory.defrag import DefragPlan, apply_defrag

if TYPE_CHECKING:
    from kvtool.memory.kv_cache import KVCache


class KVUpdateContext(UpdateContext):
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
        """Only the shifted rows are rewritten. A quantized K row is dequantized, rotated back
        out of the Hadamard basis, re-rotated by its delta, rotated in again and quantized, as
        llama.cpp's build_rope_shift does for a quantized cache."""
        cache = self.cache
        tk, rot = cache.params.type_k, cache.rot_k
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
                rows = dequantize(k[s].index_select(0, ti), tk, cache.specs[il].head_dim_k)
                if rot:
                    rows = fwht(rows, rot)
                rows = cache.shift_fn(il, rows, delta)
                if rot:
                    rows = fwht(rows, rot)
                k[s].index_copy_(0, ti, quantize(rows, tk))
