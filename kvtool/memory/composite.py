"""Memories made of parts (llama.cpp's iSWA and hybrid memories): every operation goes to every
part, planned on all of them before any changes, so it is all or nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvtool.errors import StateError
from kvtool.memory.base import (
    Commit,
    FailedPrepare,
    GraphInputs,
    MemoryContext,
    MemoryPart,
    MemoryStatus,
    NoUpdate,
    SeqOp,
    SeqOps,
)
from kvtool.memory.sizes import MemoryBreakdown

if TYPE_CHECKING:
    from kvtool.batch import BatchAllocator, UBatch
    from kvtool.memory.base import LayerView
    from kvtool.state.io import StateReader, StateWriter


def _all(commits: list[Commit]) -> Commit:
    def run() -> None:
        for c in commits:
            c()

    return run


class Composite(SeqOps):
    """Parts in order, the primary one first. Positions are those every part still holds:
    seq_pos_min is the largest of the parts' minimums, seq_pos_max the smallest maximum (as
    llama.cpp's hybrid memory reports them)."""

    kind = "composite"

    def __init__(self, parts: Mapping[str, MemoryPart]) -> None:
        self.parts: dict[str, MemoryPart] = dict(parts)
        self._route: dict[int, str] = {}
        for name, part in self.parts.items():
            for il in part.layers:
                if il in self._route:
                    raise ValueError(f"layer {il} belongs to two memory parts")
                self._route[il] = name

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self._route)

    # -- sequences ------------------------------------------------------------------------------
    def plan(self, op: SeqOp) -> Commit:
        return _all([p.plan(op) for p in self.parts.values()])  # a refusal raises before any commit

    def seq_pos_min(self, seq_id: int) -> int:
        return max(p.seq_pos_min(seq_id) for p in self.parts.values())

    def seq_pos_max(self, seq_id: int) -> int:
        return min(p.seq_pos_max(seq_id) for p in self.parts.values())

    def seq_can_resume(self, seq_id: int, pos: int) -> bool:
        return all(p.seq_can_resume(seq_id, pos) for p in self.parts.values())

    def can_shift(self) -> bool:
        return all(p.can_shift() for p in self.parts.values())

    def n_used(self) -> int:
        return next(iter(self.parts.values())).n_used()

    def memory_breakdown(self) -> MemoryBreakdown:
        """Every part's bytes, named as the composite names it."""
        out = MemoryBreakdown()
        for name, p in self.parts.items():
            out += p.memory_breakdown().named(name)
        return out

    # -- batches --------------------------------------------------------------------------------
    def init_batch(self, alloc: BatchAllocator, n_ubatch: int) -> MemoryContext:
        """One split for every part: the strictest any part needs."""
        ubatches = alloc.split(n_ubatch, max(p.split for p in self.parts.values()))
        plans = [p.prepare(ubatches) for p in self.parts.values()]
        if any(plan is None for plan in plans):
            return FailedPrepare()
        ctxs = {
            name: p.context(ubatches, plan) for (name, p), plan in zip(self.parts.items(), plans, strict=True)
        }
        return CompositeContext(ctxs, self._route, MemoryStatus.SUCCESS)

    def init_update(self, optimize: bool = False) -> MemoryContext:
        ups = {name: p.init_update(optimize) for name, p in self.parts.items()}
        if all(u.status == MemoryStatus.NO_UPDATE for u in ups.values()):
            return NoUpdate()
        return CompositeContext(ups, self._route, MemoryStatus.SUCCESS)

    # -- state ----------------------------------------------------------------------------------
    def state_write(self, w: StateWriter, seq: int | None) -> None:
        w.layout["kind"] = self.kind
        for name, p in self.parts.items():
            p.state_write(w.part(name), seq)

    def state_read(self, r: StateReader, seq: int | None) -> Commit:
        r.expect_kind(self.kind)
        if r.part_names() != sorted(self.parts):
            raise StateError(f"corrupted state: the parts of the '{self.kind}' memory do not match")
        return _all([p.state_read(r.part(name), seq) for name, p in self.parts.items()])


class CompositeContext:
    """Steps the parts' contexts together; each layer gets its view from the part that holds it."""

    def __init__(self, parts: dict[str, MemoryContext], route: dict[int, str], status: MemoryStatus) -> None:
        self.parts = parts
        self.route = route
        self.status = status

    @property
    def ubatch(self) -> UBatch:
        return next(iter(self.parts.values())).ubatch

    def next(self) -> bool:
        return all([c.next() for c in self.parts.values()])

    def apply(self) -> bool:
        return all([c.apply() for c in self.parts.values()])

    def layer_view(self, il: int) -> LayerView:
        return self.parts[self.route[il]].layer_view(il)

    def rollback(self) -> None:
        for c in reversed(self.parts.values()):
            c.rollback()

    def graph_inputs(self) -> GraphInputs | None:
        """Every part's, or None where one part's views cannot be replayed."""
        parts = [c.graph_inputs() for c in self.parts.values()]
        if any(p is None for p in parts):
            return None
        return tuple(p[0] for p in parts if p is not None), [t for p in parts if p is not None for t in p[1]]
