"""What a memory holds, as a comparable value: to check that a failed operation changed nothing.

The snapshot does not depend on where cells sit (a failed batch under the on-fail policy may
compact the cache first, which moves cells but changes nothing a sequence holds): per KV stream,
the sorted (position, sequences, pending shift, K and V rows of every layer) of its used cells;
per recurrent sequence, its position, snapshot count, which sequences share its slot, and the
bytes of its states and of the snapshots it may use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtool.memory.kv_cache import KVCache
from kvtool.memory.recurrent import RecurrentMemory


def _kv(cache: KVCache) -> tuple[Any, ...]:
    out = []
    for s, c in enumerate(cache.cells):
        rows = []
        for i in np.flatnonzero(c.pos != c.EMPTY).tolist():
            kv = tuple(t[s, i].float().numpy().tobytes() for t in (*cache.k.values(), *cache.v.values()))
            rows.append((int(c.pos[i]), int(c.seq[i]), int(c.shift[i]), kv))
        out.append(tuple(sorted(rows)))
    return tuple(out)


def _recurrent(mem: RecurrentMemory) -> tuple[Any, ...]:
    cells, t = mem.cells, mem.states.t
    out = []
    for s in range(mem.n_seq_max):
        slot = int(cells.tail[s])
        if slot < 0:
            out.append(None)
            continue
        k = int(cells.n_hist[s])
        data = tuple(x[slot].numpy().tobytes() for name in ("conv", "ssm") for x in t[name].values())
        hist = tuple(x[slot, :k].numpy().tobytes() for name in ("hconv", "hssm") for x in t[name].values())
        sharing = tuple(int(o) for o in np.flatnonzero(cells.tail == slot))
        out.append((int(cells.pos[s]), k, sharing, data, hist))
    return tuple(out)


def snapshot(mem: Any) -> Any:
    """A value equal for two memories holding the same sequences, contents and pending work."""
    if isinstance(mem, KVCache):
        return ("kv", _kv(mem))
    if isinstance(mem, RecurrentMemory):
        return ("recurrent", _recurrent(mem))
    parts = getattr(mem, "parts", None)
    if parts is None:
        raise TypeError(f"no snapshot for {type(mem).__name__}")
    return tuple((name, snapshot(p)) for name, p in parts.items())
