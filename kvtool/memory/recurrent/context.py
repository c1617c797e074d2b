"""One planned batch on a RecurrentMemory: gives each ubatch sequence a slot it may write and
hands recurrent layers their states."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtool.memory.base import GraphInputs, MemoryStatus
from kvtool.memory.recurrent.view import RSView

if TYPE_CHECKING:
    from kvtool.batch import UBatch
    from kvtool.memory.recurrent.memory import RecurrentMemory


class RecurrentContext:
    """`apply()` moves each sequence of the current ubatch to a private slot (copy on write)
    and sets its position; `layer_view(il)` reads the slots, and the view's `store` writes them."""

    status = MemoryStatus.SUCCESS

    def __init__(self, memory: RecurrentMemory, ubatches: list[UBatch]) -> None:
        self.memory = memory
        self.ubatches = ubatches
        self.i = 0
        self._slots: torch.Tensor | None = None
        self._n_states = 1

    @property
    def ubatch(self) -> UBatch:
        return self.ubatches[self.i]

    def next(self) -> bool:
        self.i += 1
        self._slots = None
        if self.i >= len(self.ubatches):
            self.memory.end_batch()  # the whole batch is in: nothing left to undo
            return False
        return True

    def apply(self) -> bool:
        mem, ub = self.memory, self.ubatch
        if self.i == 0:
            first: dict[int, int] = {}
            for u in self.ubatches:
                for s, p in zip(u.seq_id.tolist(), u.pos.tolist(), strict=True):
                    first[s] = min(p, first.get(s, p))
            mem.begin_batch(first)
        cells, k, t = mem.cells, mem.n_rs_seq, ub.n_seq_tokens
        slots = []
        for b, seq in enumerate(ub.seq_id_unq):
            had = cells.has(seq)
            slots.append(mem.own_slot(seq))
            # snapshots: this ubatch's earlier tokens, then the state before it and its snapshots
            older = int(cells.n_hist[seq]) + 1 if had else 0
            cells.n_hist[seq] = min(k, t - 1 + older)
            cells.pos[seq] = int(ub.pos[(b + 1) * t - 1])
        self._slots = torch.tensor(slots, dtype=torch.int64, device=mem.device)
        self._n_states = min(k + 1, t)
        return True

    def rollback(self) -> None:
        if self.i < len(self.ubatches):  # else the batch ended and there is nothing to undo
            self.memory.undo_batch()

    def graph_inputs(self) -> GraphInputs | None:
        """None: a layer's view gathers its states by slot and stores them back as it goes."""
        return None

    def layer_view(self, il: int) -> RSView:
        assert self._slots is not None, "apply() first"
        mem, slots, n_states = self.memory, self._slots, self._n_states

        def sink(conv: torch.Tensor, ssm: torch.Tensor) -> None:
            mem.states.store(il, slots, conv, ssm, n_states)

        return RSView(mem.states.t["conv"][il][slots], mem.states.t["ssm"][il][slots], n_states, sink)
