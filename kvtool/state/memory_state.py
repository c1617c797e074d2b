"""Each memory kind writes and reads its own part of a state; composites delegate to their parts.

Reading is two-phase: `plan_read` validates everything and works out where every row goes on
copies of the cell bookkeeping, returning commits; only running the commits touches the live
memory. A composite plans all of its parts before any commit runs, so a load is all or nothing.

Tensors of a KVCache part, prefixed by the part's path ("memory." or "memory.base." ...), one
row per used cell: `pos` I32 [n], `seq` U64 [n] (sequence bitset), `shift` I32 [n] (pending K
shift), `cell` I32 [n] (index in its stream), and per attention layer il `k.{il}`
[n, n_head_kv, head_dim_k] and `v.{il}` [n, n_head_kv, head_dim_v] in the cache's type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtool.errors import StateError
from kvtool.memory.kv_cache import KVCache
from kvtool.memory.kv_cells import KVCells, seq_bit
from kvtool.memory.swa_kv_cache import SWAKVCache
from kvtool.state.container import _FROM_TORCH, Array, RawTensor

Commit = Callable[[], None]
SeqCounts = dict[int, int]  # seq id -> cells written

# Composite kinds: their name in a state and their parts, in order.
COMPOSITES: dict[type, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    SWAKVCache: ("swa_kv", lambda m: {"base": m.base, "swa": m.swa}),
}
_ALL_POS = 2**31 - 1


def memory_kind(memory: object) -> str:
    if isinstance(memory, KVCache):
        return "kv"
    for cls, (name, _) in COMPOSITES.items():
        if isinstance(memory, cls):
            return name
    raise StateError(f"saving a {type(memory).__name__} is not supported")


def _parts(memory: object) -> dict[str, Any] | None:
    for cls, (_, parts) in COMPOSITES.items():
        if isinstance(memory, cls):
            return parts(memory)
    return None


def n_seq_max(memory: object) -> int:
    parts = _parts(memory)
    if parts is not None:
        return n_seq_max(next(iter(parts.values())))
    if isinstance(memory, KVCache):
        return memory.params.n_seq_max
    raise StateError(f"saving a {type(memory).__name__} is not supported")


# -- write --------------------------------------------------------------------------------------
def write_memory(
    memory: object, seq: int | None, prefix: str = "memory."
) -> tuple[dict[str, Any], dict[str, Array], SeqCounts]:
    """(layout, tensors, cells per sequence) of the used cells (of `seq` only, if given)."""
    kind = memory_kind(memory)
    parts = _parts(memory)
    if parts is None:
        return _kv_write(memory, seq, prefix)  # type: ignore[arg-type]
    layouts: dict[str, Any] = {}
    tensors: dict[str, Array] = {}
    counts: SeqCounts = {}
    for name, part in parts.items():
        layouts[name], t, c = write_memory(part, seq, f"{prefix}{name}.")
        tensors.update(t)
        for s, n in c.items():  # the part holding the most cells of a sequence speaks for it
            counts[s] = max(counts.get(s, 0), n)
    return {"kind": kind, "parts": layouts}, tensors, counts


def _kv_layout(cache: KVCache, n_rows: int) -> dict[str, Any]:
    swa = cache.params.swa
    return {
        "kind": "kv",
        "unified": cache.params.unified,
        "n_stream": cache.n_stream,
        "n_cells": cache.n_cells,
        "dtype": _FROM_TORCH[cache.params.dtype],
        "swa": None if swa is None else {"n_swa": swa.n_swa, "kind": swa.kind},
        "layers": [[il, s.n_head_kv, s.head_dim_k, s.head_dim_v] for il, s in sorted(cache.layers.items())],
        "n_rows": n_rows,
    }


def _kv_write(
    cache: KVCache, seq: int | None, prefix: str
) -> tuple[dict[str, Any], dict[str, Array], SeqCounts]:
    if seq is not None and not 0 <= seq < cache.params.n_seq_max:
        raise StateError(f"sequence {seq} is out of range (n_seq_max = {cache.params.n_seq_max})")
    streams = range(cache.n_stream) if seq is None else [cache.stream_of(seq)]
    pos, mask, shift, cell, rows = [], [], [], [], []
    for s in streams:
        c = cache.cells[s]
        idx = np.flatnonzero(c.used() if seq is None else c.used() & c.has_seq(seq))
        m = c.seq[idx] if seq is None else np.full(len(idx), seq_bit(seq), dtype=np.uint64)
        if cache.params.swa is not None and seq is not None:
            # As llama.cpp, a sequence state of a window cache keeps only what the sequence's
            # last position still sees (p_max - p < n_swa). A context state keeps every cell,
            # so the layout, and with it every later logit, comes back bitwise.
            pmax = c.seq_pos_max_all()
            for q in c.seq_ids():
                m[((m & seq_bit(q)) != 0) & cache.params.swa.masked(c.pos[idx], pmax[q])] &= ~seq_bit(q)
            idx, m = idx[m != 0], m[m != 0]
        pos.append(c.pos[idx])
        mask.append(m)
        shift.append(c.shift[idx])
        cell.append(idx)
        rows.append((s, torch.from_numpy(idx).to(cache.params.device)))
    tensors: dict[str, Array] = {
        f"{prefix}pos": np.concatenate(pos).astype(np.int32),
        f"{prefix}seq": np.concatenate(mask).astype(np.uint64),
        f"{prefix}shift": np.concatenate(shift).astype(np.int32),
        f"{prefix}cell": np.concatenate(cell).astype(np.int32),
    }
    for il in sorted(cache.layers):
        for name, t in (("k", cache.k[il]), ("v", cache.v[il])):
            tensors[f"{prefix}{name}.{il}"] = torch.cat([t[s].index_select(0, i) for s, i in rows])
    bits = np.concatenate(mask).astype(np.uint64)
    counts = {s: int(np.count_nonzero(bits & seq_bit(s))) for s in range(64) if (bits & seq_bit(s)).any()}
    return _kv_layout(cache, len(bits)), tensors, counts


# -- read ---------------------------------------------------------------------------------------
def plan_read(
    memory: object, layout: Any, tensors: dict[str, RawTensor], seq: int | None, prefix: str = "memory."
) -> list[Commit]:
    """Validates the memory part of a state against `memory` and plans its placement. Takes the
    tensors it uses out of `tensors`. Nothing is mutated until the returned commits run."""
    kind = memory_kind(memory)
    saved = layout.get("kind") if isinstance(layout, dict) else None
    if saved != kind:
        raise StateError(f"state holds a '{saved}' memory but this context has a '{kind}' memory")
    parts = _parts(memory)
    if parts is None:
        return [_kv_plan(memory, layout, tensors, seq, prefix)]  # type: ignore[arg-type]
    if not isinstance(layout.get("parts"), dict) or set(layout["parts"]) != set(parts):
        raise StateError(f"corrupted state: the parts of the '{kind}' memory do not match")
    commits: list[Commit] = []
    for name, part in parts.items():
        commits += plan_read(part, layout["parts"][name], tensors, seq, f"{prefix}{name}.")
    return commits


def _take(tensors: dict[str, RawTensor], name: str, dtype: str, shape: tuple[int, ...]) -> RawTensor:
    t = tensors.pop(name, None)
    if t is None or t.dtype != dtype or t.shape != shape:
        raise StateError(f"corrupted state: tensor {name} is missing or has the wrong type or shape")
    return t


def _check_layout(cache: KVCache, layout: dict[str, Any]) -> int:
    want = _kv_layout(cache, 0)
    for key, what in (("layers", "attention layers"), ("dtype", "K/V type"), ("swa", "sliding window")):
        if layout.get(key) != want[key]:
            raise StateError(
                f"state does not fit this context: {what} differ "
                f"(state {layout.get(key)}, context {want[key]})"
            )
    n = layout.get("n_rows")
    if not isinstance(n, int) or n < 0:
        raise StateError("corrupted state: bad row count")
    return n


def _check_rows(pos: np.ndarray, mask: np.ndarray, n_seq: int | None) -> list[int]:
    """The sequences present; refuses bad positions, empty or out-of-range masks (n_seq: the
    bound, None when the rows go to another sequence id anyway), duplicate positions."""
    if (pos < 0).any() or (pos > _ALL_POS).any() or (mask == 0).any():
        raise StateError("corrupted state: bad cell positions or sequence sets")
    seqs = [s for s in range(64) if (mask & seq_bit(s)).any()]
    if n_seq is not None and seqs and seqs[-1] >= n_seq:
        raise StateError(f"state holds sequence {seqs[-1]} but this context has n_seq_max = {n_seq}")
    for s in seqs:
        p = pos[(mask & seq_bit(s)) != 0]
        if len(np.unique(p)) != len(p):
            raise StateError(f"corrupted state: sequence {s} has a position twice")
    return seqs


def _same_cells(cells: KVCells, idx: np.ndarray) -> np.ndarray | None:
    """The saved cell indices if they are all free here: restoring rows where they were keeps
    the attention layout, so logits come back bitwise (else the rows go to any free cells)."""
    fits = len(idx) and idx.max() < cells.size and len(np.unique(idx)) == len(idx)
    return idx if fits and (cells.pos[idx] == -1).all() else None


def _kv_plan(
    cache: KVCache, layout: dict[str, Any], tensors: dict[str, RawTensor], seq: int | None, prefix: str
) -> Commit:
    n = _check_layout(cache, layout)
    pos = _take(tensors, f"{prefix}pos", "I32", (n,)).numpy().astype(np.int64)
    mask = _take(tensors, f"{prefix}seq", "U64", (n,)).numpy()
    shift = _take(tensors, f"{prefix}shift", "I32", (n,)).numpy().astype(np.int64)
    cell = _take(tensors, f"{prefix}cell", "I32", (n,)).numpy().astype(np.int64)
    kv: dict[str, torch.Tensor] = {}
    for il, nh, dk, dv in layout["layers"]:
        kv[f"k.{il}"] = _take(tensors, f"{prefix}k.{il}", layout["dtype"], (n, nh, dk)).torch()
        kv[f"v.{il}"] = _take(tensors, f"{prefix}v.{il}", layout["dtype"], (n, nh, dv)).torch()
    n_seq = cache.params.n_seq_max
    seqs = _check_rows(pos, mask, n_seq if seq is None else None)
    if (cell < 0).any():
        raise StateError("corrupted state: bad cell indices")
    placed: list[tuple[int, KVCells, np.ndarray, np.ndarray]] = []  # stream, new cells, rows, cells
    if seq is None:
        for t in range(cache.n_stream):
            keep = ~np.uint64(0) if cache.params.unified else seq_bit(t)
            rows = np.flatnonzero(mask & keep)
            if len(rows) > cache.n_cells:
                raise StateError(
                    f"state needs {len(rows)} cells in stream {t} but this context has {cache.n_cells}"
                )
            c = KVCells(cache.n_cells)
            idx = _same_cells(c, cell[rows])
            if idx is None:
                idx = np.arange(len(rows))
            c.apply(idx, pos[rows], mask[rows] & keep)
            placed.append((t, c, rows, idx))
    else:
        if not 0 <= seq < n_seq:
            raise StateError(f"sequence {seq} is out of range (n_seq_max = {n_seq})")
        if len(seqs) > 1 or (mask & (mask - np.uint64(1))).any():
            raise StateError("corrupted state: a sequence state holds cells of several sequences")
        t = cache.stream_of(seq)
        c = cache.cells[t].copy()
        c.seq_rm(seq, 0, _ALL_POS)
        rows = np.arange(n)
        idx = _same_cells(c, cell)
        if idx is None:
            idx = c.find_slot(n, cache.params.swa) if n else np.zeros(0, dtype=np.int64)
        if idx is None:
            raise StateError(
                f"no room: the sequence needs {n} cells, stream {t} has {c.size - c.n_used()} free"
            )
        c.apply(idx, pos, np.full(n, seq_bit(seq), dtype=np.uint64))
        placed.append((t, c, rows, idx))
    for _, c, rows, idx in placed:
        c.shift[idx] = shift[rows]
        c.has_shift = bool(c.shift.any())

    def commit() -> None:
        for t, c, rows, idx in placed:
            vars(cache.cells[t]).update(vars(c))
            ri = torch.from_numpy(rows)
            ci = torch.from_numpy(idx).to(cache.params.device)
            for name, src in kv.items():
                dst = (cache.k if name[0] == "k" else cache.v)[int(name[2:])]
                dst[t].index_copy_(0, ci, src.index_select(0, ri).to(dst.device))

    return commit
