"""The memory contract (llama.cpp's llama_memory_i): plan a batch, then apply it ubatch by ubatch.

Every memory kind (KV cache, sliding-window pair, recurrent state, hybrid) implements `Memory`.
Sequence operations are planned first and committed second: `plan(op)` validates the operation
and returns a `Commit` without changing anything (or raises `MemoryRefused`), so a composite can
plan on all of its parts before any of them changes (all or nothing). `SeqOps` turns `plan` into
the usual `seq_rm`/`seq_cp`/... calls.

Memories that can be parts of a composite also implement `MemoryPart`: how they need a batch
split, a side-effect-free placement plan for a list of ubatches, and the context applying it.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from kvtool.checks import POS_END, as_int
from kvtool.errors import KvtoolError

if TYPE_CHECKING:
    import torch

    from kvtool.batch import BatchAllocator, Split, UBatch
    from kvtool.memory.kv_cache_context import KVView
    from kvtool.memory.recurrent.view import RSView
    from kvtool.memory.sizes import MemoryBreakdown
    from kvtool.state.io import StateReader, StateWriter

    # what a layer computes with: an attention layer's cache view, a recurrent layer's states
    LayerView: TypeAlias = KVView | RSView

Commit = Callable[[], None]

# What the layers' views read that changes from one ubatch to the next (kvtool/graphs.py): a key
# naming everything else they depend on (which streams, how many cells), and the device tensors
# (cache rows, visibility) that `apply()` builds afresh for every ubatch.
GraphInputs = tuple["Hashable", list["torch.Tensor"]]


class MemoryStatus(enum.Enum):
    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2  # no room for the batch: nothing was changed


class MemoryRefused(KvtoolError):
    """A memory operation that cannot be done (no room, no rollback state...); nothing changed."""


# -- sequence operations (llama_memory_seq_*): negative p0/p1 are open bounds -------------------
class _IntFields:
    """Checks an operation's int fields as it is made: a float or a string is a TypeError, a
    shift or divisor past a position's range is refused, before any memory plans it."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            object.__setattr__(self, name, as_int(value, f"{type(self).__name__}.{name}"))
        for name in ("delta", "d"):
            v = getattr(self, name, 0)
            if abs(v) >= POS_END:
                raise MemoryRefused(f"{name} = {v} is past a position's range ({POS_END})")


@dataclass(frozen=True)
class Clear:
    data: bool  # also zero the tensors


@dataclass(frozen=True)
class SeqRm(_IntFields):
    seq_id: int  # < 0: every sequence
    p0: int
    p1: int


@dataclass(frozen=True)
class SeqCp(_IntFields):
    src: int
    dst: int
    p0: int
    p1: int


@dataclass(frozen=True)
class SeqKeep(_IntFields):
    seq_id: int


@dataclass(frozen=True)
class SeqAdd(_IntFields):
    seq_id: int
    p0: int
    p1: int
    delta: int


@dataclass(frozen=True)
class SeqDiv(_IntFields):
    seq_id: int
    p0: int
    p1: int
    d: int


SeqOp = Clear | SeqRm | SeqCp | SeqKeep | SeqAdd | SeqDiv


def pos_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's convention: a negative bound is open ([0, inf)); bounds past the last
    position are the open bound too."""
    lo = 0 if p0 < 0 else min(p0, POS_END)
    hi = POS_END if p1 < 0 else min(p1, POS_END)
    return lo, hi


# -- contexts -----------------------------------------------------------------------------------
class MemoryContext(Protocol):
    """One planned batch (or update). `apply()` is the only call that mutates the memory.

    A batch context also hands each layer the view of the memory it computes with, for the
    current ubatch: `layer_view(il)` (a `KVView` for attention layers, a recurrent view for
    state-space layers): the layer computes, the memory only provides tensors and indices.
    `graph_inputs()` says whether the views of the applied ubatch can be replayed by a captured
    graph: None where they cannot (the layers' work then runs op by op)."""

    status: MemoryStatus

    def next(self) -> bool: ...
    def apply(self) -> bool: ...
    @property
    def ubatch(self) -> UBatch: ...
    def layer_view(self, il: int) -> LayerView: ...
    def graph_inputs(self) -> GraphInputs | None: ...
    def rollback(self) -> None:
        """Undoes every `apply()` of this batch so far (a failed decode): the memory is as it
        was before the first, cells, positions and the rows a ubatch overwrote included."""
        ...


class UpdateContext:
    """A memory update (pending shifts, ...): one step, no ubatch, no layer views."""

    status = MemoryStatus.SUCCESS

    def next(self) -> bool:
        return False

    def apply(self) -> bool:
        return True

    @property
    def ubatch(self) -> UBatch:
        raise RuntimeError("an update context has no ubatch")

    def layer_view(self, il: int) -> LayerView:
        raise RuntimeError("an update context has no layer views")

    def graph_inputs(self) -> GraphInputs | None:
        return None

    def rollback(self) -> None:
        if self.status == MemoryStatus.SUCCESS:
            raise RuntimeError("a memory update cannot be undone")
        # NO_UPDATE, FAILED_PREPARE: nothing was applied


class NoUpdate(UpdateContext):
    """The update context when nothing is pending."""

    status = MemoryStatus.NO_UPDATE


class FailedPrepare(NoUpdate):
    """A batch that does not fit: nothing was planned, nothing changes."""

    status = MemoryStatus.FAILED_PREPARE


# -- the contract -------------------------------------------------------------------------------
class Memory(Protocol):
    """What a context asks of its memory. Positions of a sequence are contiguous between
    seq_pos_min and seq_pos_max (-1 when the sequence is empty)."""

    @property
    def kind(self) -> str:
        """The name recorded in state files ("kv", "swa_kv", ...)."""
        ...

    def init_batch(self, alloc: BatchAllocator, n_ubatch: int) -> MemoryContext: ...
    def init_update(self, optimize: bool = False) -> MemoryContext:
        """Pending work (K re-rotation after seq_add/seq_div, compaction when the memory's
        defrag policy asks for it, or whenever it has holes with `optimize`): NO_UPDATE when none."""
        ...

    def plan(self, op: SeqOp) -> Commit:
        """Validates `op` and returns what performs it; raises MemoryRefused. Changes nothing."""
        ...

    def clear(self, data: bool) -> None: ...
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_keep(self, seq_id: int) -> None: ...
    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None: ...
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    def seq_can_resume(self, seq_id: int, pos: int) -> bool:
        """Whether, once positions >= pos of the sequence are removed, a token at `pos` still
        finds everything it depends on (a sliding window or a recurrent state may have lost it)."""
        ...

    def can_shift(self) -> bool: ...
    def n_used(self) -> int:
        """Cells (or state slots) in use: of the primary part, for a composite."""
        ...

    def memory_breakdown(self) -> MemoryBreakdown:
        """The bytes this memory holds, part by part, and the cells each part uses per stream
        (llama.cpp's memory_breakdown)."""
        ...

    def state_write(self, w: StateWriter, seq: int | None) -> None:
        """Writes the layout and tensors of every sequence (seq None) or of one."""
        ...

    def state_read(self, r: StateReader, seq: int | None) -> Commit:
        """Validates a saved part against this memory and plans its placement; only running the
        returned commit changes the memory (seq None: replaces every sequence; else the saved
        sequence becomes `seq`)."""
        ...


class MemoryPart(Memory, Protocol):
    """A memory that a composite can combine with others over one split of the batch."""

    @property
    def layers(self) -> frozenset[int]:
        """The layers whose views this memory gives."""
        ...

    @property
    def split(self) -> Split:
        """How batches must be cut into ubatches for this memory."""
        ...

    def prepare(self, ubatches: list[UBatch]) -> object | None:
        """Simulates placing every ubatch: an opaque plan, or None when one does not fit."""
        ...

    def context(self, ubatches: list[UBatch], plan: object) -> MemoryContext:
        """The context that applies `plan` ubatch by ubatch."""
        ...


class SeqOps(abc.ABC):
    """The sequence operations of the contract, performed through `plan`."""

    @abc.abstractmethod
    def plan(self, op: SeqOp) -> Commit:
        """Validates `op` and returns what performs it; raises MemoryRefused."""

    def clear(self, data: bool) -> None:
        self.plan(Clear(data))()

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """False (and nothing changed) when the memory cannot remove that range."""
        try:
            commit = self.plan(SeqRm(seq_id, p0, p1))
        except MemoryRefused:
            return False
        commit()
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.plan(SeqCp(src, dst, p0, p1))()

    def seq_keep(self, seq_id: int) -> None:
        self.plan(SeqKeep(seq_id))()

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self.plan(SeqAdd(seq_id, p0, p1, delta))()

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.plan(SeqDiv(seq_id, p0, p1, d))()


class PartBatches:
    """`init_batch` for a MemoryPart: split as it needs, plan, and build its context."""

    def init_batch(self: Any, alloc: BatchAllocator, n_ubatch: int) -> MemoryContext:
        ubatches = alloc.split(n_ubatch, self.split)
        plan = self.prepare(ubatches)
        return FailedPrepare() if plan is None else self.context(ubatches, plan)
