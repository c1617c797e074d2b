"""Recurrent state memory (llama.cpp's llama_memory_recurrent), for Mamba, Mamba-2 and RWKV.

Each sequence owns one state per recurrent layer, overwritten at every token: a short
convolution (or token-shift) state and an SSM (or WKV) state, both F32. There are `n_seq_max`
slots; `seq_cp` makes the destination read the source's slot (it gets a copy when one of them
next writes), `seq_add`/`seq_div` move only the position, and a state cannot be cut back: a
partial `seq_rm` is refused, unless rollback snapshots cover it.

Rollback (`n_rs_seq = K`, llama.cpp's name): every slot also keeps the states after each of
its last K positions, so `seq_rm(seq, p, -1)` succeeds when it takes back at most K tokens
(pos - p + 1 <= K, pos the sequence's last position) and the snapshots exist. The model
supplies them: `RSView.n_states` asks for the states after each of the trailing
`min(K + 1, n_seq_tokens)` tokens of the ubatch, not only the last one.

A batch that fails part way (an exception in a forward pass) is undone by the context with
`seq_rm(s, first_pos_of_s_in_batch, -1)`: the memory keeps each sequence's state from before
the batch until the batch's last ubatch is done, and that exact removal restores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtool.batch import DecodeError, Split
from kvtool.checks import POS_END, as_int
from kvtool.memory.base import (
    Clear,
    Commit,
    MemoryRefused,
    NoUpdate,
    PartBatches,
    SeqAdd,
    SeqCp,
    SeqDiv,
    SeqKeep,
    SeqOp,
    SeqOps,
    SeqRm,
    pos_range,
)
from kvtool.memory.recurrent.cells import RSCells
from kvtool.memory.recurrent.context import RecurrentContext
from kvtool.memory.recurrent.state_part import read_state, write_state
from kvtool.memory.recurrent.states import RSStates, Snapshot
from kvtool.memory.recurrent.view import RSLayerSpec
from kvtool.memory.sizes import MemoryBreakdown, PartSize

if TYPE_CHECKING:
    from kvtool.batch import UBatch
    from kvtool.memory.spec import MemoryParams
    from kvtool.state.io import StateReader, StateWriter

_MAX_POS = POS_END


@dataclass(frozen=True)
class RecurrentSpec:
    """The recurrent layers of a model; `build` makes its memory for a context."""

    layers: dict[int, RSLayerSpec]

    def build(self, params: MemoryParams) -> RecurrentMemory:
        """n_seq_max state slots (KV sizes and kv_unified do not apply), n_rs_seq snapshots."""
        return RecurrentMemory(self.layers, max(1, params.n_seq_max), params.n_rs_seq, params.device)

    def memory_breakdown(self, params: MemoryParams) -> MemoryBreakdown:
        """Every slot's F32 states and snapshots (RSStates)."""
        n_slot = max(1, params.n_seq_max)
        per_slot = 4 * (1 + params.n_rs_seq) * sum(s.numel() for s in self.layers.values())
        return states_breakdown(n_slot, len(self.layers), n_slot * per_slot, 0)


def states_breakdown(n_slot: int, n_layer: int, nbytes: int, used: int) -> MemoryBreakdown:
    """A recurrent memory's one part: its slots (one stream) and the bytes of their states."""
    return MemoryBreakdown((PartSize("", "recurrent", n_slot, 1, (used,), n_layer, states=nbytes),))


@dataclass
class _Saved:
    """A sequence's state before a batch (to undo the batch if it fails)."""

    first_pos: int  # the sequence's first position in the batch
    cells: RSCells  # bookkeeping of that sequence only matters
    states: Snapshot | None  # None: it had no state


class RecurrentMemory(PartBatches, SeqOps):
    """`n_seq_max` state slots: the cells say which sequence reads which slot (RSCells), the
    states hold the tensors (RSStates); this class plans the sequence operations on both."""

    kind = "recurrent"
    split = Split.EQUAL

    def __init__(
        self,
        layers: dict[int, RSLayerSpec],
        n_seq_max: int,
        n_rs_seq: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        if n_rs_seq < 0:
            raise ValueError(f"n_rs_seq must be >= 0, got {n_rs_seq}")
        self.specs = dict(layers)
        self.n_seq_max = n_seq_max
        self.n_rs_seq = n_rs_seq
        self.device = torch.device(device)
        self.cells = RSCells.empty(n_seq_max)
        self.states = RSStates(self.specs, n_seq_max, n_rs_seq, self.device)
        self._undo: dict[int, _Saved] | None = None

    @property
    def layers(self) -> frozenset[int]:
        return frozenset(self.specs)

    def memory_breakdown(self) -> MemoryBreakdown:
        """The bytes of the states allocated (current and snapshots, every slot), the slots used."""
        return states_breakdown(self.n_seq_max, len(self.specs), self.states.nbytes(), self.n_used())

    # -- slots --------------------------------------------------------------------------------
    def own_slot(self, seq: int) -> int:
        """The slot `seq` may write: a zeroed new one if it has none, a copy if it is shared."""
        cells = self.cells
        slot = int(cells.tail[seq])
        if slot < 0:
            slot = cells.free_slot()
            self.states.zero(slot)
            cells.tail[seq] = slot
        elif cells.users(slot) > 1:
            new = cells.free_slot()
            self.states.copy(slot, new)
            cells.tail[seq] = slot = new
        return slot

    # -- sequences ------------------------------------------------------------------------------
    def seq_pos_min(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return int(self.cells.pos[seq_id])

    def seq_pos_max(self, seq_id: int) -> int:
        return self.seq_pos_min(seq_id)  # a state only knows its latest position

    def seq_can_resume(self, seq_id: int, pos: int) -> bool:
        """True when the state after pos-1 exists: pos 0, the next position, or a snapshot."""
        if pos <= 0:
            return True
        cur = self.seq_pos_max(seq_id)
        if pos > cur:
            return pos == cur + 1
        return cur - (pos - 1) <= int(self.cells.n_hist[seq_id])

    def can_shift(self) -> bool:
        return False

    def n_used(self) -> int:
        return self.cells.n_used()

    def init_update(self, optimize: bool = False) -> NoUpdate:
        return NoUpdate()

    def _can_undo(self, seq: int, p0: int) -> bool:
        return self._undo is not None and seq in self._undo and self._undo[seq].first_pos == p0

    def plan(self, op: SeqOp) -> Commit:
        if isinstance(op, SeqRm):
            return self._plan_rm(op)
        commit = self._plan_other(op)

        def run() -> None:
            self._undo = None  # the saved pre-batch states no longer describe these sequences
            commit()

        return run

    def _check_seq(self, seq: int) -> None:
        if not 0 <= as_int(seq, "a sequence id") < self.n_seq_max:
            raise MemoryRefused(f"invalid seq_id {seq} (n_seq_max = {self.n_seq_max})")

    def _plan_rm(self, op: SeqRm) -> Commit:
        lo, hi = pos_range(op.p0, op.p1)
        cells = self.cells
        if op.seq_id < 0:
            if lo == hi:
                return lambda: None
            if (lo, hi) != (0, _MAX_POS):
                raise MemoryRefused("recurrent memory: a range of every sequence cannot be removed")
            return cells.reset
        seq = op.seq_id
        self._check_seq(seq)
        if self._can_undo(seq, lo) and hi == _MAX_POS:
            return lambda: self._restore(seq)
        if not cells.has(seq):
            return lambda: None
        p = int(cells.pos[seq])
        if 0 < lo <= p < hi:
            r = p - (lo - 1)  # tokens to take back
            if r > int(cells.n_hist[seq]):
                raise MemoryRefused(f"recurrent memory: sequence {seq} cannot be cut back to position {lo}")
            return lambda: self._commit_rollback(seq, r)
        if lo <= p < hi:
            return lambda: cells.detach(seq)
        return lambda: None

    def _commit_rollback(self, seq: int, r: int) -> None:
        slot = self.own_slot(seq)
        self.states.rollback(slot, r)
        self.cells.pos[seq] -= r
        self.cells.n_hist[seq] -= r

    def _restore(self, seq: int) -> None:
        assert self._undo is not None
        saved = self._undo.pop(seq)
        cells = self.cells
        cells.detach(seq)
        if saved.states is not None:
            slot = cells.free_slot()
            self.states.restore(slot, saved.states)
            cells.tail[seq] = slot
            cells.pos[seq] = saved.cells.pos[seq]
            cells.n_hist[seq] = saved.cells.n_hist[seq]

    def _plan_other(self, op: SeqOp) -> Commit:
        cells = self.cells
        if isinstance(op, Clear):
            return lambda: self._clear(op.data)
        if isinstance(op, SeqCp):
            self._check_seq(op.src)
            self._check_seq(op.dst)
            return lambda: self._cp(op.src, op.dst)
        if isinstance(op, SeqKeep):
            self._check_seq(op.seq_id)

            def keep() -> None:
                for s in range(self.n_seq_max):
                    if s != op.seq_id:
                        cells.detach(s)

            return keep
        if isinstance(op, SeqAdd | SeqDiv):
            self._check_seq(op.seq_id)
            if isinstance(op, SeqDiv) and op.d < 1:
                raise MemoryRefused(f"seq_div needs a divisor >= 1, got {op.d}")
            lo, hi = pos_range(op.p0, op.p1)
            seq, p = op.seq_id, int(cells.pos[op.seq_id])
            if lo == hi or not cells.has(seq) or not lo <= p < hi:
                return lambda: None
            if isinstance(op, SeqAdd):
                if p + op.delta < 0:  # as KV cells pushed below position 0: the state is freed
                    return lambda: cells.detach(seq)
                if p + op.delta >= POS_END:
                    raise MemoryRefused(
                        f"seq_add: sequence {seq} would pass the last position ({POS_END - 1})"
                    )
                return lambda: cells.pos.__setitem__(seq, p + op.delta)

            def div() -> None:
                cells.pos[seq] = p // op.d
                cells.n_hist[seq] = 0  # snapshots no longer sit at consecutive positions

            return div if op.d != 1 else (lambda: None)
        raise TypeError(f"unknown sequence operation {op!r}")

    def _clear(self, data: bool) -> None:
        self.cells.reset()
        if data:
            self.states.zero_all()

    def _cp(self, src: int, dst: int) -> None:
        if src == dst:
            return
        cells = self.cells
        cells.detach(dst)
        if cells.has(src):
            cells.tail[dst] = cells.tail[src]
            cells.pos[dst] = cells.pos[src]
            cells.n_hist[dst] = cells.n_hist[src]

    # -- batches --------------------------------------------------------------------------------
    def prepare(self, ubatches: list[UBatch]) -> object | None:
        """Every sequence has a slot of its own (or gets a free one), so a batch always fits;
        a token shared by several sequences is refused (their states would have to be one)."""
        for ub in ubatches:
            if any(bin(int(m)).count("1") > 1 for m in ub.seq_mask):
                raise DecodeError(
                    "a token belongs to several sequences, which recurrent memory cannot hold: "
                    "decode it for each sequence (or seq_cp after it)",
                    -1,
                )
        return True

    def context(self, ubatches: list[UBatch], plan: object) -> RecurrentContext:
        return RecurrentContext(self, ubatches)

    def begin_batch(self, first_pos: dict[int, int]) -> None:
        """Saves the state of every sequence the batch writes (`first_pos`: seq -> its first
        position in the batch), so a failed batch can be undone."""
        self._undo = {}
        for seq, p in first_pos.items():
            slot = int(self.cells.tail[seq])
            self._undo[seq] = _Saved(p, self.cells.copy(), None if slot < 0 else self.states.snapshot(slot))

    def end_batch(self) -> None:
        self._undo = None

    def undo_batch(self) -> None:
        """Puts back the state every sequence of the batch had before it (a failed decode)."""
        for seq in list(self._undo or ()):
            self._restore(seq)
        self._undo = None

    # -- state ----------------------------------------------------------------------------------
    def state_write(self, w: StateWriter, seq: int | None) -> None:
        write_state(self, w, seq)

    def state_read(self, r: StateReader, seq: int | None) -> Commit:
        return read_state(self, r, seq)
