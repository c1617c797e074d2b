"""A conversation context on a model: memory, decode, logits (llama_context)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtool.batch import Batch, BatchAllocator, DecodeError
from kvtool.errors import KvtoolError
from kvtool.memory.base import MemoryStatus
from kvtool.memory.kv_cache import KVCache, KVCacheParams

if TYPE_CHECKING:
    from kvtool.model import Model

_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class ContextParams:
    """llama_context_params that kvtool honours. n_ctx=0 takes the model's training context."""

    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = False
    swa_full: bool = False
    type_k: str = "f32"
    type_v: str = "f32"
    n_threads: int | None = None


def pad(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


class Context:
    """Decodes batches of tokens against a memory that remembers them."""

    def __init__(self, model: Model, params: ContextParams | None = None) -> None:
        p = params or ContextParams()
        if not 1 <= p.n_seq_max <= 64:
            raise KvtoolError(f"n_seq_max must be between 1 and 64, got {p.n_seq_max}")
        if p.n_batch < 1 or p.n_ubatch < 1:
            raise KvtoolError("n_batch and n_ubatch must be positive")
        for t in (p.type_k, p.type_v):
            if t not in _DTYPES:
                raise KvtoolError(f"unsupported KV cache type '{t}' (f32, f16, bf16)")
        if p.n_threads:
            torch.set_num_threads(p.n_threads)
        self.model = model
        self.params = p
        self.n_batch = p.n_batch
        self.n_ubatch = min(p.n_ubatch, p.n_batch)
        n_ctx = p.n_ctx if p.n_ctx > 0 else model.n_ctx_train
        if p.kv_unified:
            self.n_ctx_seq = pad(n_ctx)
            self.n_ctx = self.n_ctx_seq
        else:
            if n_ctx % p.n_seq_max:
                warnings.warn(
                    f"n_ctx ({n_ctx}) is not divisible by n_seq_max ({p.n_seq_max}): "
                    f"each sequence gets pad256(n_ctx / n_seq_max) cells",
                    stacklevel=2,
                )
            self.n_ctx_seq = pad(n_ctx // p.n_seq_max)
            self.n_ctx = self.n_ctx_seq * p.n_seq_max
        self.memory = self._build_memory()
        self._logits = torch.empty(0, model.n_vocab)
        self._out_row = np.zeros(0, dtype=np.int64)  # batch index -> logits row (-1: none)
        self.n_decoded = 0  # tokens computed over the context's life (for timings)

    def _build_memory(self) -> KVCache:
        spec = self.model.memory_spec()
        p = self.params
        kv_params = KVCacheParams(
            n_cells=self.n_ctx_seq,
            n_seq_max=p.n_seq_max,
            unified=p.kv_unified,
            dtype=_DTYPES[p.type_k],
        )
        return KVCache(spec.kv, kv_params, self.model.rope_shift)

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> None:
        """Computes the batch. Raises DecodeError with llama_decode's status on failure, in which
        case the memory is as it was before the call."""
        if len(batch) > self.n_batch:
            raise DecodeError(f"batch of {len(batch)} tokens exceeds n_batch = {self.n_batch}", -1)
        alloc = BatchAllocator(batch, self.model.n_vocab, self.params.n_seq_max, self.memory)
        upd = self.memory.init_update(False)
        if upd.status == MemoryStatus.SUCCESS:
            upd.apply()
        mctx = self.memory.init_batch(alloc, self.n_ubatch, False)
        if mctx.status != MemoryStatus.SUCCESS:
            raise DecodeError(
                f"no room in the KV cache for {alloc.n_tokens} tokens "
                f"(n_ctx = {self.n_ctx}, {self.n_ctx_seq} cells per stream)",
                1,
            )
        out_row = np.cumsum(alloc.output) - 1
        out_row[~alloc.output] = -1
        logits = torch.empty(alloc.n_outputs, self.model.n_vocab)
        try:
            with torch.inference_mode():
                while True:
                    mctx.apply()
                    ub = mctx.ubatch
                    rows = self.model.forward(ub, mctx)
                    if ub.output.any():
                        logits[torch.from_numpy(out_row[ub.idx[ub.output]])] = rows
                    if not mctx.next():
                        break
        except BaseException:
            self._rollback(alloc)
            raise
        self._logits = logits
        self._out_row = out_row
        self.n_decoded += alloc.n_tokens

    def _rollback(self, alloc: BatchAllocator) -> None:
        """Forget every position this batch may have written (llama.cpp does the same)."""
        for s in alloc.seq_ids_in_batch():
            lo = int(min(p for p, sids in zip(alloc.pos, alloc.batch.seq_ids, strict=True) if s in sids))
            self.memory.seq_rm(s, lo, -1)

    def logits(self) -> torch.Tensor:
        """float32 [n_outputs, n_vocab]: the last decode's logits, in batch order."""
        return self._logits

    def logits_ith(self, i: int) -> torch.Tensor:
        """The logits row of batch token i (negative: counted from the last output)."""
        if i < 0:
            if -i > len(self._logits):
                raise IndexError(f"no output {i}")
            return self._logits[len(self._logits) + i]
        if i >= len(self._out_row) or self._out_row[i] < 0:
            raise IndexError(f"batch token {i} has no logits (it was not flagged as an output)")
        return self._logits[int(self._out_row[i])]

    # -- memory shortcuts -----------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every sequence (llama_memory_clear(data=true))."""
        self.memory.clear(True)

    def n_used_cells(self) -> int:
        return self.memory.n_used()
