"""State files of a recurrent memory: each saved sequence's position and its F32 states.

Layout: `kind` "recurrent", `layers` [[il, conv_shape, ssm_shape], ...], `n_rows`. Tensors,
prefixed by the part's path: `seq` I32 [n], `pos` I32 [n], and per layer `conv.{il}`
[n, *conv_shape] and `ssm.{il}` [n, *ssm_shape]. Rollback snapshots are not saved: a loaded
sequence continues from its last position (as llama.cpp's state files)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtool.errors import StateError
from kvtool.memory.base import Commit

if TYPE_CHECKING:
    from kvtool.memory.recurrent.memory import RecurrentMemory
    from kvtool.state.io import StateReader, StateWriter


def _layers(mem: RecurrentMemory) -> list[list[object]]:
    return [[il, list(s.conv_shape), list(s.ssm_shape)] for il, s in sorted(mem.specs.items())]


def write_state(mem: RecurrentMemory, w: StateWriter, seq: int | None) -> None:
    """Every sequence with a state (seq None), or `seq` alone."""
    if seq is not None and not 0 <= seq < mem.n_seq_max:
        raise StateError(f"sequence {seq} is out of range (n_seq_max = {mem.n_seq_max})")
    cells = mem.cells
    seqs = [s for s in (range(mem.n_seq_max) if seq is None else [seq]) if cells.has(s)]
    slots = torch.tensor([int(cells.tail[s]) for s in seqs], dtype=torch.int64, device=mem.device)
    w.layout.update(kind=mem.kind, layers=_layers(mem), n_rows=len(seqs))
    w.put("seq", np.array(seqs, dtype=np.int32))
    w.put("pos", np.array([int(cells.pos[s]) for s in seqs], dtype=np.int32))
    for name in ("conv", "ssm"):
        for il, t in mem.states.t[name].items():
            w.put(f"{name}.{il}", t[slots].cpu())
    for s in seqs:
        w.count(s, 1)


def read_state(mem: RecurrentMemory, r: StateReader, seq: int | None) -> Commit:
    """Validates the saved part; the commit places it (seq None: replaces every sequence;
    else the one saved sequence, if any, becomes `seq`)."""
    r.expect_kind(mem.kind)
    if r.layout.get("layers") != _layers(mem):
        raise StateError("state does not fit this model: its recurrent layers differ")
    n = r.layout.get("n_rows")
    if not isinstance(n, int) or n < 0:
        raise StateError("corrupted state: bad recurrent row count")
    seqs = r.take_numpy("seq", "I32", (n,)).tolist()
    pos = r.take_numpy("pos", "I32", (n,)).tolist()
    states = {
        name: {
            il: r.take_torch(f"{name}.{il}", "F32", (n, *getattr(s, f"{name}_shape"))).to(mem.device)
            for il, s in mem.specs.items()
        }
        for name in ("conv", "ssm")
    }
    if not all(bool(t.isfinite().all()) for ts in states.values() for t in ts.values()):
        raise StateError("corrupted state: recurrent states hold NaN or infinite values")
    if any(p < 0 for p in pos) or len(set(seqs)) != n:
        raise StateError("corrupted state: bad recurrent positions or sequences")
    if seq is None:
        if any(not 0 <= s < mem.n_seq_max for s in seqs):
            raise StateError(f"state holds sequences beyond n_seq_max = {mem.n_seq_max}")
        dest = seqs
    else:
        if not 0 <= seq < mem.n_seq_max:
            raise StateError(f"sequence {seq} is out of range (n_seq_max = {mem.n_seq_max})")
        if n > 1:
            raise StateError("state holds several sequences; load it without a destination sequence")
        dest = [seq] * n

    def commit() -> None:
        mem._undo = None
        if seq is None:
            mem.cells.reset()
        else:
            mem.cells.detach(seq)
        for row, s in enumerate(dest):
            slot = mem.own_slot(s)
            for name, ts in states.items():
                for il, t in ts.items():
                    mem.states.t[name][il][slot].copy_(t[row])
            mem.cells.pos[s] = pos[row]

    return commit
