"""A KVCache's part of a state file (docs/state-format.md): one row per used cell.

Tensors, under the part's prefix: `pos` I32 [n], `seq` U64 [n] (sequence bitset), `shift` I32
[n] (pending K shift), `cell` I32 [n] (index in its stream), and per attention layer il `k.{il}`
[n, n_head_kv, head_dim_k] in type_k and `v.{il}` [n, n_head_kv, head_dim_v] in type_v (a
quantized type: U8 [n, n_head_kv, bytes of a head's blocks], the blocks as the cache holds them).
Reading plans on copies of the cells and validates everything; only the commit changes the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtool.checks import POS_END
from kvtool.errors import StateError
from kvtool.kernels.kv_quant import blocks_finite
from kvtool.memory.base import Commit
from kvtool.memory.kv_cells import KVCells, seq_bit
from kvtool.state.container import shown
from kvtool.state.io import StateReader, StateWriter, type_name

if TYPE_CHECKING:
    from kvtool.memory.kv_cache import KVCache

_ALL_POS = POS_END


def layout(cache: KVCache, n_rows: int) -> dict[str, Any]:
    p = cache.params
    return {
        "kind": cache.kind,
        "unified": p.unified,
        "n_stream": cache.n_stream,
        "n_cells": cache.n_cells,
        "type_k": p.type_k.name.upper(),
        "type_v": p.type_v.name.upper(),
        "swa": None if p.swa is None else {"n_swa": p.swa.n_swa, "kind": p.swa.kind},
        "layers": [[il, s.n_head_kv, s.head_dim_k, s.head_dim_v] for il, s in sorted(cache.specs.items())],
        "n_rows": n_rows,
    }


def write(cache: KVCache, w: StateWriter, seq: int | None) -> None:
    """The used cells (of `seq` only, if given)."""
    if seq is not None and not 0 <= seq < cache.params.n_seq_max:
        raise StateError(f"sequence {seq} is out of range (n_seq_max = {cache.params.n_seq_max})")
    swa = cache.params.swa
    streams = range(cache.n_stream) if seq is None else [cache.stream_of(seq)]
    pos, mask, shift, cell, rows = [], [], [], [], []
    for s in streams:
        c = cache.cells[s]
        idx = np.flatnonzero(c.used() if seq is None else c.used() & c.has_seq(seq))
        m = c.seq[idx] if seq is None else np.full(len(idx), seq_bit(seq), dtype=np.uint64)
        if swa is not None and seq is not None:
            # As llama.cpp, a sequence state of a window cache keeps only what the sequence's
            # last position still sees (p_max - p < n_swa). A context state keeps every cell,
            # so the layout, and with it every later logit, comes back bitwise.
            pmax = c.seq_pos_max_all()
            for q in c.seq_ids():
                m[((m & seq_bit(q)) != 0) & swa.masked(c.pos[idx], pmax[q])] &= ~seq_bit(q)
            idx, m = idx[m != 0], m[m != 0]
        pos.append(c.pos[idx])
        mask.append(m)
        shift.append(c.shift[idx])
        cell.append(idx)
        rows.append((s, torch.from_numpy(idx).to(cache.params.device)))
    bits = np.concatenate(mask).astype(np.uint64)
    w.layout.update(layout(cache, len(bits)))
    w.put("pos", np.concatenate(pos).astype(np.int32))
    w.put("seq", bits)
    w.put("shift", np.concatenate(shift).astype(np.int32))
    w.put("cell", np.concatenate(cell).astype(np.int32))
    for il in sorted(cache.specs):
        for name, t in (("k", cache.k[il]), ("v", cache.v[il])):
            w.put(f"{name}.{il}", torch.cat([t[s].index_select(0, i) for s, i in rows]))
    for s in range(64):
        n = int(np.count_nonzero(bits & seq_bit(s)))
        if n:
            w.count(s, n)


def _check_layout(cache: KVCache, saved: Any) -> int:
    want = layout(cache, 0)
    for key, what in (
        ("layers", "attention layers"),
        ("type_k", "K type"),
        ("type_v", "V type"),
        ("swa", "sliding window"),
    ):
        if saved.get(key) != want[key]:
            hint = (
                " (a state loads into a context of the cache types it was saved from)"
                if "type" in key
                else ""
            )
            raise StateError(
                f"state does not fit this context: {what} differ "
                f"(state {shown(saved.get(key), 60)}, context {want[key]}){hint}"
            )
    n = saved.get("n_rows")
    if not isinstance(n, int) or n < 0:
        raise StateError("corrupted state: bad row count")
    return n


def _check_rows(pos: np.ndarray, mask: np.ndarray, n_seq: int | None) -> list[int]:
    """The sequences present; refuses bad positions, empty or out-of-range masks (n_seq: the
    bound, None when the rows go to another sequence id anyway). Two cells of one sequence may
    share a position: seq_div (self-extend), seq_add and seq_cp make such states legitimately."""
    if (pos < 0).any() or (pos > _ALL_POS).any() or (mask == 0).any():
        raise StateError("corrupted state: bad cell positions or sequence sets")
    seqs = [s for s in range(64) if (mask & seq_bit(s)).any()]
    if n_seq is not None and seqs and seqs[-1] >= n_seq:
        raise StateError(f"state holds sequence {seqs[-1]} but this context has n_seq_max = {n_seq}")
    return seqs


def _same_cells(cells: KVCells, idx: np.ndarray) -> np.ndarray | None:
    """The saved cell indices if they are all free here: restoring rows where they were keeps
    the attention layout, so logits come back bitwise (else the rows go to any free cells)."""
    fits = len(idx) and idx.max() < cells.size and len(np.unique(idx)) == len(idx)
    return idx if fits and (cells.pos[idx] == -1).all() else None


def plan_read(cache: KVCache, r: StateReader, seq: int | None) -> Commit:
    r.expect_kind(cache.kind)
    n = _check_layout(cache, r.layout)
    pos = r.take_numpy("pos", "I32", (n,)).astype(np.int64)
    mask = r.take_numpy("seq", "U64", (n,))
    shift = r.take_numpy("shift", "I32", (n,)).astype(np.int64)
    cell = r.take_numpy("cell", "I32", (n,)).astype(np.int64)
    kv: dict[str, torch.Tensor] = {}
    tk, tv = cache.params.type_k, cache.params.type_v  # the saved types: _check_layout compared them
    for il, nh, dk, dv in r.layout["layers"]:
        kv[f"k.{il}"] = r.take_torch(f"k.{il}", type_name(tk.dtype), (n, nh, tk.width(dk)))
        kv[f"v.{il}"] = r.take_torch(f"v.{il}", type_name(tv.dtype), (n, nh, tv.width(dv)))
    if not all(blocks_finite(t, tk if name[0] == "k" else tv) for name, t in kv.items()):
        # no decode writes these (a NaN row poisons every later logit of its sequence)
        raise StateError("corrupted state: K/V rows hold NaN or infinite values")
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
            cache.cells[t] = c  # the planned bookkeeping becomes the stream's
            ri = torch.from_numpy(rows)
            ci = torch.from_numpy(idx).to(cache.params.device)
            for name, src in kv.items():
                dst = (cache.k if name[0] == "k" else cache.v)[int(name[2:])]
                dst[t].index_copy_(0, ci, src.index_select(0, ri).to(dst.device))

    return commit
