"""`defrag-sim --replay`: the planned moves of a simulated workload, run by the engine on a real
KV cache of a model, through the engine's public API only.

The cells of the first stream that a compacting policy compacted, as they were just before
that compaction (positions and sequences), are built in a real cache by decoding: a filler
sequence first takes every cell (cell i at position i); then, in groups, the cells to place are
freed from the filler and one decode places the group's tokens, each as a scratch sequence of
its own at its cell's position (the slot search takes the freed cells lowest first, in batch
order), shared into the cell's sequences (`seq_cp`, metadata only in one stream) before the
scratch is removed; the filler goes last and leaves the holes. A token's K/V rows are what it
computes alone at its position (the check is about moving rows, not about what they hold).

Every sequence then decodes one query token, the engine compacts (`Context.update(optimize=True)`,
the planner's passes over every layer's K and V), and the same queries are decoded again. The
reference is a second cache built by the same decodes with each token placed in its cell after
compaction (the planner's moves, `plan_defrag`): the logits after compaction must equal
its logits bit for bit, and those before within float noise (attention sums over the cells in
cell order, holes included, so a different layout rounds differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kvtool
from kvtool.common.cells import KVCells, plan_defrag

MAX_CELLS = 8192  # a real cache of a real model
FILLER = 63  # the sequence id that holds every cell while the loader places tokens
GROUP = 48  # tokens per loading decode, at most


@dataclass(frozen=True)
class ReplayResult:
    n_cells: int  # cells in use
    n_moves: int
    n_passes: int
    bitwise: bool  # after compaction == a cache built in the compacted layout
    max_diff: float  # after compaction vs before


def _context(model: kvtool.Model, size: int, max_moves: int, type_k: str, type_v: str) -> kvtool.Context:
    p = kvtool.ContextParams(
        n_ctx=size,
        n_ubatch=64,
        n_seq_max=64,
        kv_unified=True,
        defrag_max_moves=max_moves,
        type_k=type_k,
        type_v=type_v,
    )
    return kvtool.Context(model, p)


def _fill(ctx: kvtool.Context) -> None:
    """The filler takes every cell, cell i at position i."""
    n = ctx.n_ctx
    for p0 in range(0, n, 2048):
        ids = [1] * min(2048, n - p0)
        ctx.decode(kvtool.Batch.from_tokens(ids, FILLER, p0, logits="none"))


def _load(ctx: kvtool.Context, groups: list[list[tuple[int, int, int]]]) -> None:
    """Places each group's (cell, pos, sequence bits) tokens in one decode: their cells are
    freed from the filler, and the slot search takes the free cells from the lowest (the head
    falls back to the lowest freed cell), in the batch's order: cells ascending. Each token is a
    scratch sequence of its own (an empty sequence starts anywhere; ids the cells do not use),
    then shared into its cell's sequences and the scratch removed (metadata only, one stream)."""
    mem = ctx.memory
    used = set()
    for g in groups:
        for _, _, bits in g:
            used |= {s for s in range(FILLER) if bits >> s & 1}
    scratch = [s for s in range(FILLER) if s not in used]
    _fill(ctx)
    for group in groups:
        b = kvtool.Batch()
        for k, (cell, pos, bits) in enumerate(group):
            mem.seq_rm(FILLER, cell, cell + 1)
            b.add(1 + (pos * 7919 + bits * 104729) % (ctx.model.n_vocab - 1), pos, [scratch[k]], False)
        ctx.decode(b)
        for k, (_, _, bits) in enumerate(group):
            for s in range(FILLER):
                if bits >> s & 1:
                    mem.seq_cp(scratch[k], s, -1, -1)
            mem.seq_rm(scratch[k], -1, -1)
    mem.seq_rm(FILLER, -1, -1)


def _groups(cells: KVCells, where: np.ndarray, n: int) -> list[list[tuple[int, int, int, int]]]:
    """The used cells (cell, its cell after compaction, pos, sequence bits) in order, at most n
    per group, each group ascending after compaction too (the planner keeps the order of the
    cells that stay and of those that move, so a group breaks where the two meet)."""
    groups: list[list[tuple[int, int, int, int]]] = []
    for i in np.flatnonzero(cells.pos != KVCells.EMPTY).tolist():
        tok = (i, int(where[i]), int(cells.pos[i]), int(cells.seq[i]))
        if not groups or len(groups[-1]) == n or tok[1] < groups[-1][-1][1]:
            groups.append([])
        groups[-1].append(tok)
    return groups


def _queries(ctx: kvtool.Context, seqs: list[int]) -> torch.Tensor:
    b = kvtool.Batch()
    for s in seqs:
        b.add(1 + s % (ctx.model.n_vocab - 1), ctx.memory.seq_pos_max(s) + 1, [s], True)
    ctx.decode(b)
    out = ctx.logits().clone()
    for s in seqs:  # forget the queries: the cells are as loaded again
        ctx.memory.seq_rm(s, ctx.memory.seq_pos_max(s), -1)
    return out


def replay(
    model: kvtool.Model, cells: KVCells, max_moves: int, type_k: str = "f16", type_v: str = "f16"
) -> ReplayResult:
    """Runs the compaction of `cells` on a cache of `model` with K/V of these types; see the
    module docstring."""
    seqs = cells.seq_ids()
    n_scratch = min(GROUP, FILLER - len(seqs))
    if FILLER in seqs or n_scratch < 1:
        raise kvtool.KvtoolError("--replay: the stream uses every sequence id: it cannot be rebuilt")
    plan = plan_defrag(cells, max_moves)
    where = np.arange(cells.size)  # cell -> its cell after compaction
    for moves in plan.passes:
        for src, dst, n in moves.tolist():
            where[src : src + n] = np.arange(dst, dst + n)
    groups = _groups(cells, where, n_scratch)
    ctx, ref = (_context(model, cells.size, max_moves, type_k, type_v) for _ in range(2))
    _load(ctx, [[(c, p, b) for c, _, p, b in g] for g in groups])
    # the same decodes, each token in its cell after compaction: the same K/V rows, moved
    _load(ref, [[(w, p, b) for _, w, p, b in g] for g in groups])
    before = _queries(ctx, seqs)
    ctx.update(optimize=True)
    after = _queries(ctx, seqs)
    moved = _queries(ref, seqs)
    return ReplayResult(
        int(np.count_nonzero(cells.pos != KVCells.EMPTY)),
        plan.n_moves,
        plan.n_passes,
        torch.equal(after, moved),
        float((after - before).abs().max()),
    )
