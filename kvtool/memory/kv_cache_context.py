"""One planned batch on a KVCache: applies ubatches and serves attention layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtool.kernels.attention import attention
from kvtool.kernels.store_kv import store_kv
from kvtool.memory.base import MemoryStatus

if TYPE_CHECKING:
    from kvtool.batch import UBatch
    from kvtool.memory.kv_cache import KVCache


class KVCacheContext:
    """Plan of a batch: ubatches and their cell slots. `apply()` writes the current ubatch's
    cells; `attend()` stores a layer's new K/V rows and runs attention per stream."""

    def __init__(
        self, cache: KVCache, ubatches: list[UBatch], slots: list[list[np.ndarray]], status: MemoryStatus
    ) -> None:
        self.cache = cache
        self.ubatches = ubatches
        self.slots = slots
        self.status = status
        self.i = 0
        self._rows: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._streams = slice(0, 1)
        self._n_kv = 0

    @property
    def ubatch(self) -> UBatch:
        return self.ubatches[self.i]

    def next(self) -> bool:
        self.i += 1
        self._rows = self._mask = None
        return self.i < len(self.ubatches)

    def apply(self) -> bool:
        """Writes the current ubatch into its cells and builds its attention inputs."""
        cache, ub = self.cache, self.ubatch
        streams = cache._ubatch_streams(ub)
        per = ub.n_tokens // len(streams)
        rows = []
        for b, (s, idx) in enumerate(zip(streams, self.slots[self.i], strict=True)):
            sl = slice(b * per, (b + 1) * per)
            cache.cells[s].apply(idx, ub.pos[sl], ub.seq_mask[sl])
            rows.append(s * cache.n_cells + idx)
        self._streams = slice(streams[0], streams[-1] + 1)
        assert streams == list(range(streams[0], streams[-1] + 1)), "ubatch streams must be consecutive"
        self._n_kv = max(cache.cells[s].used_max_p1() for s in streams)
        self._rows = torch.from_numpy(np.concatenate(rows)).to(cache.params.device)
        self._mask = self._build_mask(ub, streams, per).to(cache.params.device)
        return True

    def _build_mask(self, ub: UBatch, streams: list[int], per: int) -> torch.Tensor:
        """[n_stream_ub, per, n_kv] additive mask: 0 where the query's sequence owns the cell,
        the cell is not in its future, and (sliding window) not too far in its past."""
        n_kv = self._n_kv
        swa = self.cache.params.swa
        out = np.empty((len(streams), per, n_kv), dtype=np.float32)
        for b, s in enumerate(streams):
            cells = self.cache.cells[s]
            cp = cells.pos[:n_kv][None, :]  # [1, n_kv]
            cs = cells.seq[:n_kv][None, :]
            qp = ub.pos[b * per : (b + 1) * per].astype(np.int64)[:, None]  # [per, 1]
            qs = ub.seq_id[b * per : (b + 1) * per].astype(np.uint64)[:, None]
            vis = ((cs >> qs) & np.uint64(1)).astype(bool) & (cp <= qp) & (cp >= 0)
            if swa is not None:
                vis &= ~swa.masked(cp, qp)
            out[b] = np.where(vis, np.float32(0.0), np.float32(-np.inf))
        return torch.from_numpy(out)

    def attend(
        self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [n_tokens, n_head, d_k], k [n_tokens, n_head_kv, d_k], v [n_tokens, n_head_kv, d_v]
        -> [n_tokens, n_head * d_v]. Stores k and v in this layer's cells first."""
        assert self._rows is not None and self._mask is not None, "apply() first"
        cache = self.cache
        kc, vc = cache.k[il], cache.v[il]  # [n_stream, n_cells, n_head_kv, d]
        n = q.shape[0]
        store_kv(kc.view(-1, kc.shape[2] * kc.shape[3]), k.reshape(n, -1), self._rows)
        store_kv(vc.view(-1, vc.shape[2] * vc.shape[3]), v.reshape(n, -1), self._rows)
        n_s = self._streams.stop - self._streams.start
        qs = q.reshape(n_s, n // n_s, q.shape[1], q.shape[2])  # [n_stream_ub, per, n_head, d_k]
        ks = kc[self._streams, : self._n_kv]  # [n_stream_ub, n_kv, n_head_kv, d_k]
        vs = vc[self._streams, : self._n_kv]
        out = attention(qs, ks.to(q.dtype), vs.to(q.dtype), self._mask, scale)  # [n_stream_ub, per, H, d_v]
        return out.reshape(n, -1)
