"""The visibility mask a KV cache builds once per ubatch (all streams at once, shared by every
layer) against the specification in kernels/visibility.py, over random cells with holes,
shared cells, several sequences per stream and sliding windows."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvtool.batch import Batch, BatchAllocator
from kvtool.kernels.visibility import Cells, visibility_mask
from kvtool.memory.base import MemoryStatus
from kvtool.memory.kv_cache import KVCache, KVCacheParams, KVLayerSpec
from kvtool.memory.kv_cells import SWAParams

N_SEQ = 3


def _spec_mask(cache: KVCache, alloc_ub, streams: list[int], n_kv: int) -> torch.Tensor:
    per = alloc_ub.n_tokens // len(streams)
    swa = cache.params.swa
    cells = Cells(
        torch.from_numpy(np.stack([cache.cells[s].pos[:n_kv] for s in streams])),
        torch.from_numpy(np.stack([cache.cells[s].seq[:n_kv] for s in streams]).view(np.int64)),
        torch.from_numpy(alloc_ub.pos.astype(np.int64).reshape(len(streams), per)),
        torch.from_numpy(alloc_ub.seq_id.astype(np.int64).reshape(len(streams), per)),
        *((swa.kind, swa.n_swa) if swa is not None else ()),
    )
    return visibility_mask(cells)


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "split"])
@pytest.mark.parametrize("swa", [None, SWAParams(5), SWAParams(4, "chunked"), SWAParams(6, "symmetric")])
def test_mask_built_once_matches_the_specification(unified: bool, swa: SWAParams | None) -> None:
    rng = random.Random(hash((unified, swa and swa.kind)) & 0xFFFF)
    specs = {il: KVLayerSpec(2, 4, 4) for il in range(3)}
    cache = KVCache(specs, KVCacheParams(n_cells=64, n_seq_max=N_SEQ, unified=unified, swa=swa), None)
    nxt = [0] * N_SEQ
    for _ in range(12):
        if rng.random() < 0.3:  # holes: forget a random tail or head of a sequence
            s = rng.randrange(N_SEQ)
            if nxt[s] > 2:
                cut = rng.randrange(1, nxt[s])
                if rng.random() < 0.5:
                    cache.seq_rm(s, cut, -1)
                    nxt[s] = cut
                else:
                    cache.seq_rm(s, 0, cut)
        b = Batch()
        for s in range(N_SEQ):  # each sequence 1-3 new tokens (decode steps and short prompts)
            n = 1 if rng.random() < 0.6 else rng.randint(2, 3)
            for _ in range(n):
                b.add(1, nxt[s], (s,), False)
                nxt[s] += 1
        alloc = BatchAllocator(b, 10, N_SEQ, cache)
        mctx = cache.init_batch(alloc, 16)
        assert mctx.status == MemoryStatus.SUCCESS
        while True:
            mctx.apply()
            views = [mctx.layer_view(il) for il in specs]
            assert all(v.mask is views[0].mask for v in views)  # one mask for every layer
            mask = views[0].mask
            assert mask is not None
            streams = list(range(views[0].streams.start, views[0].streams.stop))
            want = _spec_mask(cache, mctx.ubatch, streams, views[0].n_kv)
            assert torch.equal(mask.mask, want)
            assert mask.empty is None  # every query sees its own cell
            if not mctx.next():
                break
