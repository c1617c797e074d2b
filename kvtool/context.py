"""A conversation context on a model: memory, decode, logits (llama_context)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtool import graphs
from kvtool.batch import Batch, BatchAllocator, DecodeError
from kvtool.checks import as_int
from kvtool.device import resolve_device
from kvtool.errors import KvtoolError
from kvtool.kernels.kv_quant import kv_type
from kvtool.memory.base import Memory, MemoryContext, MemoryStatus
from kvtool.memory.defrag import DEFAULT_MAX_MOVES, DefragPolicy
from kvtool.memory.spec import MemoryParams, pad
from kvtool.memory_estimate import check_fits, estimate_memory

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

    from kvtool.memory.sizes import MemoryBreakdown
    from kvtool.model import Model
    from kvtool.sampling import Sampler
    from kvtool.state.codec import Tokens
    from kvtool.state.header import StateInfo


def attn_rot_enabled(wanted: bool) -> bool:
    """llama.cpp's Hadamard rotation around a quantized cache: on unless the caller turns it off
    or LLAMA_ATTN_ROT_DISABLE is set to a non-zero number (llama.cpp's switch)."""
    flag = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "").strip()
    try:
        disabled = bool(flag) and int(flag) != 0
    except ValueError:
        disabled = False  # llama.cpp's atoi reads a word as 0
    return wanted and not disabled


@dataclass
class ContextParams:
    """llama_context_params that kvtool honours. n_ctx=0 takes the model's training context."""

    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = False
    swa_full: bool = False
    type_k: str = "f16"  # K cache type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl
    type_v: str = "f16"  # V cache type, independent of K
    n_rs_seq: int = 0  # recurrent memories: states kept per sequence, so seq_rm can roll back this far
    defrag: str = "none"  # KV compaction: none, threshold=F, on-fail (kvtool.memory.defrag)
    defrag_max_moves: int = DEFAULT_MAX_MOVES  # block moves per compaction pass
    device: str | None = None  # where K/V live and the batch computes: None is the model's device
    cuda_graphs: bool = True  # on CUDA, replay captured decode steps (kvtool/graphs.py)
    attn_rot: bool = True  # Hadamard rotation around a quantized K/V, as llama.cpp (LLAMA_ATTN_ROT_DISABLE)

    def check(self) -> DefragPolicy:
        """Raises KvtoolError naming the first parameter no context can have (before a model is
        needed: a tool checks its whole sweep before it prints or loads anything); returns the
        compaction policy `defrag` names. A field of the wrong type is a TypeError."""
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "defrag_max_moves"):
            as_int(getattr(self, name), f"ContextParams.{name}")
        if not 1 <= self.n_seq_max <= 64:
            raise KvtoolError(f"n_seq_max must be between 1 and 64, got {self.n_seq_max}")
        if self.n_ctx < 0:
            raise KvtoolError(f"n_ctx must be 0 (the model's) or positive, got {self.n_ctx}")
        if self.n_rs_seq < 0:
            raise KvtoolError(f"n_rs_seq must be 0 or positive, got {self.n_rs_seq}")
        if self.n_batch < 1 or self.n_ubatch < 1:
            raise KvtoolError("n_batch and n_ubatch must be positive")
        try:
            kv_type(self.type_k), kv_type(self.type_v)
        except ValueError as e:
            raise KvtoolError(str(e)) from None
        try:
            return DefragPolicy.parse(self.defrag, self.defrag_max_moves)
        except ValueError as e:
            raise KvtoolError(str(e)) from None


@dataclass(frozen=True)
class _Layout:
    n_ctx: int  # cells in all (n_ctx_seq per stream)
    memory: MemoryParams


def _layout(model: Model, p: ContextParams) -> _Layout:
    """The memory a context of `p` on `model` gets: checks the params (KvtoolError) and sizes the
    streams (pad256 cells each), warning where llama.cpp warns."""
    defrag = p.check()
    type_k, type_v = kv_type(p.type_k), kv_type(p.type_v)
    device = model.device if p.device is None else resolve_device(p.device)
    if device != model.device:
        raise KvtoolError(f"context device {device} differs from the model's ({model.device})")
    n_ctx = p.n_ctx if p.n_ctx > 0 else model.n_ctx_train
    if p.kv_unified:
        n_ctx_seq = pad(n_ctx)
        n_ctx = n_ctx_seq
    else:
        if n_ctx % p.n_seq_max:
            warnings.warn(
                f"n_ctx ({n_ctx}) is not divisible by n_seq_max ({p.n_seq_max}): "
                f"each sequence gets pad256(n_ctx / n_seq_max) cells",
                stacklevel=3,
            )
        n_ctx_seq = pad(n_ctx // p.n_seq_max)
        n_ctx = n_ctx_seq * p.n_seq_max
    if n_ctx_seq > model.n_ctx_train:
        warnings.warn(
            f"n_ctx_seq ({n_ctx_seq}) > n_ctx_train ({model.n_ctx_train}): "
            "possible training context overflow",
            stacklevel=3,
        )
    mp = MemoryParams(
        n_ctx_seq=n_ctx_seq,
        n_seq_max=p.n_seq_max,
        n_ubatch=min(p.n_ubatch, p.n_batch),
        kv_unified=p.kv_unified,
        swa_full=p.swa_full,
        type_k=type_k,
        type_v=type_v,
        n_rs_seq=p.n_rs_seq,
        defrag=defrag,
        device=device,
        attn_rot=attn_rot_enabled(p.attn_rot),
    )
    return _Layout(n_ctx, mp)


class Context:
    """Decodes batches of tokens against a memory that remembers them."""

    def __init__(self, model: Model, params: ContextParams | None = None) -> None:
        p = params or ContextParams()
        if not isinstance(p, ContextParams):
            raise TypeError(f"params must be a kvtool.ContextParams, got {type(p).__name__}")
        layout = _layout(model, p)
        self.defrag = layout.memory.defrag
        self.device = torch.device(layout.memory.device)
        self.model = model
        self.params = p
        self.n_batch = p.n_batch
        self.n_ubatch = layout.memory.n_ubatch
        self.n_ctx, self.n_ctx_seq = layout.n_ctx, layout.memory.n_ctx_seq
        mp = layout.memory
        spec = model.memory_spec()
        hp = model.hparams
        self.memory_estimate = estimate_memory(spec, mp, hp.n_embd, hp.n_ff, hp.n_head, model.n_vocab)
        check_fits(self.memory_estimate, self.n_ctx, mp.device)  # before allocating any of it
        self.memory: Memory = spec.build(mp)
        self.graphs = graphs.DecodeGraphs(model) if graphs.enabled(self.device, p.cuda_graphs) else None
        self._logits = torch.empty(0, model.n_vocab)
        self._out_row = np.zeros(0, dtype=np.int64)  # batch index -> logits row (-1: none)
        self.n_decoded = 0  # tokens computed over the context's life (for timings)

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, batch: Batch) -> None:
        """Computes the batch. Raises DecodeError with llama_decode's status on failure, in which
        case the memory is as it was before the call."""
        if len(batch) > self.n_batch:
            raise DecodeError(f"batch of {len(batch)} tokens exceeds n_batch = {self.n_batch}", -1)
        alloc = BatchAllocator(batch, self.model.n_vocab, self.params.n_seq_max, self.memory)
        self.update()
        mctx = self.memory.init_batch(alloc, self.n_ubatch)
        on_fail = mctx.status == MemoryStatus.FAILED_PREPARE and self.defrag.kind == "on-fail"
        if on_fail and self.update(optimize=True):
            # ollama: no contiguous slot, so compact every stream and search once more (a new
            # allocator: the failed search consumed the first one's split)
            alloc = BatchAllocator(batch, self.model.n_vocab, self.params.n_seq_max, self.memory)
            mctx = self.memory.init_batch(alloc, self.n_ubatch)
        if mctx.status != MemoryStatus.SUCCESS:
            raise DecodeError(
                f"no room in the KV cache for {alloc.n_tokens} tokens "
                f"(n_ctx = {self.n_ctx}, {self.n_ctx_seq} cells per stream)",
                1,
            )
        out_row = np.cumsum(alloc.output) - 1
        out_row[~alloc.output] = -1
        parts: list[tuple[np.ndarray, torch.Tensor]] = []  # (output rows, their logits) per ubatch
        try:
            with torch.inference_mode():
                while True:
                    mctx.apply()
                    ub = mctx.ubatch
                    if self.graphs is not None:
                        rows = self.graphs.forward(ub, mctx)
                    else:
                        rows = self.model.forward(ub, mctx)
                    if ub.output.any():  # sampled on the CPU in float32 whatever the device
                        parts.append((out_row[ub.idx[ub.output]], rows.float().cpu()))
                    if not mctx.next():
                        break
            self.model.file.check_intact()  # weights read from a file cut short are zeros
            logits = _in_batch_order(parts, alloc.n_outputs, self.model.n_vocab)
        except (MemoryError, torch.OutOfMemoryError) as e:
            mctx.rollback()
            raise DecodeError(f"compute failed: out of memory ({alloc.n_tokens} tokens)", -3) from e
        except BaseException:
            mctx.rollback()
            raise
        self._logits = logits
        self._out_row = out_row
        self.n_decoded += alloc.n_tokens

    def update(self, optimize: bool = False) -> bool:
        """Applies the memory's pending work (shifts, compaction its defrag policy asks for;
        with `optimize`, compaction of every stream with holes). llama_memory_update: decode
        calls it first. Returns whether anything was done."""
        upd: MemoryContext = self.memory.init_update(optimize)
        if upd.status != MemoryStatus.SUCCESS:
            return False
        upd.apply()
        return True

    def logits(self) -> torch.Tensor:
        """float32 [n_outputs, n_vocab]: the last decode's logits, in batch order."""
        return self._logits

    def logits_ith(self, i: int) -> torch.Tensor:
        """The logits row of batch token i (negative: counted from the last output). A token
        without logits is a KvtoolError."""
        i = as_int(i, "logits_ith's index")
        if i < 0:
            if -i > len(self._logits):
                raise KvtoolError(f"no output {i}: the last batch had {len(self._logits)}")
            return self._logits[len(self._logits) + i]
        if i >= len(self._out_row) or self._out_row[i] < 0:
            raise KvtoolError(f"batch token {i} has no logits (it was not flagged as an output)")
        return self._logits[int(self._out_row[i])]

    # -- memory shortcuts -----------------------------------------------------------------------
    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether `seq` can continue at `pos` once its positions >= pos are removed: every
        position a token at `pos` attends to must still be held. A sliding-window cache forgets
        old positions, so going back further than the window means decoding from the start
        (llama-server's "forcing full prompt re-processing ... SWA")."""
        return self.memory.seq_can_resume(seq, pos)

    def clear(self) -> None:
        """Forget every sequence (llama_memory_clear(data=true))."""
        self.memory.clear(True)

    def n_used_cells(self) -> int:
        """Cells in use (of the primary part of a composite memory)."""
        return self.memory.n_used()

    def memory_breakdown(self) -> MemoryBreakdown:
        """The bytes the context's memory holds: each KV cache (its K and V in their types) and
        the recurrent states (llama.cpp's llama_memory_breakdown)."""
        return self.memory.memory_breakdown()

    @staticmethod
    def memory_breakdown_of(model: Model, params: ContextParams) -> MemoryBreakdown:
        """What a context of `params` on `model` would hold (its `memory_breakdown()`), without
        allocating it: the KV size at any context length. KvtoolError for params a context
        refuses (an unknown type, blocks that do not tile a head...)."""
        return model.memory_spec().memory_breakdown(_layout(model, params).memory)

    # -- state (llama_state_*; the format is docs/state-format.md) --------------------------------
    # kvtool.state is imported inside the methods: it builds on the engine, not the reverse.
    def state_get_data(
        self, *, tokens: Tokens = None, sampler: Sampler | None = None, app: dict[str, object] | None = None
    ) -> bytes:
        """The whole context as a state: every sequence's cells and the last decode's logits.
        Token ids (`{seq: ids}`), the sampler's state and `app` (JSON) are stored alongside."""
        from kvtool.state import codec

        return codec.encode(self.model, self.memory, None, tokens, sampler, app, self._logits, self._out_row)

    def state_set_data(self, data: bytes) -> StateInfo:
        """Replaces every sequence and the logits with a context state. Everything is checked
        first: on StateError the context is exactly as it was."""
        from kvtool.state import codec

        loaded = codec.decode(self.model, self.memory, data, None)
        assert loaded.logits is not None and loaded.out_row is not None
        self._logits, self._out_row = loaded.logits, loaded.out_row
        return loaded.info

    def state_seq_get_data(
        self,
        seq: int,
        *,
        tokens: Tokens = None,
        sampler: Sampler | None = None,
        app: dict[str, object] | None = None,
        blobs: Mapping[str, bytes] | None = None,
    ) -> bytes:
        """Sequence `seq` as a state (its cells only; loadable into any sequence id). `blobs`
        travel with it under the checksum (StateInfo.blobs when loaded)."""
        from kvtool.state import codec

        return codec.encode(self.model, self.memory, seq, tokens, sampler, app, blobs=blobs)

    def state_seq_set_data(self, data: bytes, seq: int) -> StateInfo:
        """Replaces sequence `seq` with a sequence state (its cells need not be contiguous, the
        KV mode and n_ctx may differ). On StateError the context is exactly as it was."""
        from kvtool.state import codec

        return codec.decode(self.model, self.memory, data, seq).info

    def state_save_file(
        self,
        path: str | Path,
        seq: int | None = None,
        *,
        tokens: Tokens = None,
        sampler: Sampler | None = None,
        app: dict[str, object] | None = None,
        blobs: Mapping[str, bytes] | None = None,
    ) -> int:
        """Saves the context (seq None) or one sequence (with its `blobs`) atomically; returns
        the bytes written."""
        from kvtool.state import files

        if seq is None:
            if blobs:
                raise ValueError("blobs travel with a sequence state")
            data = self.state_get_data(tokens=tokens, sampler=sampler, app=app)
        else:
            data = self.state_seq_get_data(seq, tokens=tokens, sampler=sampler, app=app, blobs=blobs)
        return files.write_atomic(path, data)

    def state_load_file(self, path: str | Path, seq: int | None = None) -> StateInfo:
        """Loads a file saved by `state_save_file` (a sequence state needs `seq`)."""
        from kvtool.state import files

        data = files.read_file(path)
        with files.naming(path):
            return self.state_set_data(data) if seq is None else self.state_seq_set_data(data, seq)


def _in_batch_order(parts: list[tuple[np.ndarray, torch.Tensor]], n: int, n_vocab: int) -> torch.Tensor:
    """The ubatches' logits as [n, n_vocab] in batch order: one ubatch that already holds every
    output in order is taken as it is (a batch of 32 Gemma 3 rows copied 34 MB a step)."""
    if len(parts) == 1 and np.array_equal(parts[0][0], np.arange(n)):
        return parts[0][1]
    logits = torch.empty(n, n_vocab)
    for where, rows in parts:
        logits[torch.from_numpy(where)] = rows
    return logits
