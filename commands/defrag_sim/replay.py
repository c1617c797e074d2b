"""`defrag-sim --replay`: the planned moves of a simulated workload, run by the engine on a real
KV cache of a model.

The cache gets the cells of the first stream that a compacting policy compacted, as they were
just before that compaction (positions and sequences), with seeded random K/V rows (the cells'
tokens were never decoded: the check is about moving rows, not about what they hold). Every
sequence then decodes one query token, the engine compacts (`Context.update(optimize=True)`,
the planner's passes over every layer's K and V), and the same queries are decoded again.
Attention sums over the cells in cell order, holes included, so the logits after compaction are
compared bit for bit with a copy of the cache moved cell by cell to the same layout, and within
float noise with the logits before."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kvtool
from kvtool import KVCells

MAX_CELLS = 8192  # a real cache of a real model: K/V for every layer


@dataclass(frozen=True)
class ReplayResult:
    n_cells: int  # cells in use
    n_moves: int
    n_passes: int
    bitwise: bool  # after compaction == the same cells moved one by one
    max_diff: float  # after compaction vs before


def _load(ctx: kvtool.Context, cells: KVCells, seed: int) -> None:
    mem = ctx.memory
    c = mem.cells[0]  # type: ignore[attr-defined]
    n = cells.size  # the context may have padded its stream: the rest stays empty
    c.pos[:n], c.seq[:n] = cells.pos, cells.seq
    c.head = cells.head
    used = torch.from_numpy(c.pos != KVCells.EMPTY)
    g = torch.Generator().manual_seed(seed)
    for t in (*mem.k.values(), *mem.v.values()):  # type: ignore[attr-defined]
        t[0][used] = (torch.randn(t[0][used].shape, generator=g) * 0.5).to(t.dtype)


def _queries(ctx: kvtool.Context, seqs: list[int]) -> torch.Tensor:
    b = kvtool.Batch()
    for s in seqs:
        b.add(1 + s % (ctx.model.n_vocab - 1), ctx.memory.seq_pos_max(s) + 1, [s], True)
    ctx.decode(b)
    out = ctx.logits().clone()
    for s in seqs:  # forget the queries: the cells are as loaded again
        ctx.memory.seq_rm(s, ctx.memory.seq_pos_max(s), -1)
    return out


def replay(model: kvtool.Model, cells: KVCells, max_moves: int, seed: int = 0) -> ReplayResult:
    """Runs the compaction of `cells` on a cache of `model`; see the module docstring."""
    n_seq = max(cells.seq_ids()) + 1
    p = kvtool.ContextParams(
        n_ctx=cells.size, n_ubatch=64, n_seq_max=n_seq, kv_unified=True, defrag_max_moves=max_moves
    )
    ctx, ref = kvtool.Context(model, p), kvtool.Context(model, p)
    _load(ctx, cells, seed)
    _load(ref, cells, seed)
    seqs = cells.seq_ids()
    before = _queries(ctx, seqs)
    plan = kvtool.plan_defrag(ctx.memory.cells[0], max_moves)  # type: ignore[attr-defined]
    ctx.update(optimize=True)
    after = _queries(ctx, seqs)
    # the reference executor: every cell on its own, in every layer's K and V, and its metadata
    rc = ref.memory.cells[0]  # type: ignore[attr-defined]
    for moves in plan.passes:
        for src, dst, n in moves.tolist():
            for i in range(n):
                for t in (*ref.memory.k.values(), *ref.memory.v.values()):  # type: ignore[attr-defined]
                    t[0, dst + i] = t[0, src + i]
                rc.pos[dst + i], rc.seq[dst + i] = rc.pos[src + i], rc.seq[src + i]
                rc.pos[src + i], rc.seq[src + i] = KVCells.EMPTY, 0
    rc.head = ctx.memory.cells[0].head  # type: ignore[attr-defined]
    moved = _queries(ref, seqs)
    return ReplayResult(
        int(np.count_nonzero(cells.pos != KVCells.EMPTY)),
        plan.n_moves,
        plan.n_passes,
        torch.equal(after, moved),
        float((after - before).abs().max()),
    )
