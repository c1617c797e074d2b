"""Bookkeeping of a recurrent memory (no tensors): which state slot each sequence reads, its
position, and how many rollback snapshots it may use.

llama.cpp's llama_memory_recurrent keeps `n_seq_max` cells, each with a position and a set of
sequences, plus a `tail` per sequence. Here the position belongs to the sequence, not to the
slot, so sequences that share a slot after `seq_cp` can move their positions independently
(`seq_add`/`seq_div`): the state itself is shared until one of them writes (copy on write).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class RSCells:
    """tail[seq]: the slot holding the sequence's state (-1: no state); pos[seq]: the position
    of the last token folded into it; n_hist[seq]: how many snapshots (the states after
    pos-1, pos-2, ...) of its slot's history it may roll back to."""

    tail: np.ndarray  # [n_seq_max] int32
    pos: np.ndarray  # [n_seq_max] int32
    n_hist: np.ndarray  # [n_seq_max] int32

    @classmethod
    def empty(cls, n_seq_max: int) -> RSCells:
        return cls(
            tail=np.full(n_seq_max, -1, dtype=np.int32),
            pos=np.full(n_seq_max, -1, dtype=np.int32),
            n_hist=np.zeros(n_seq_max, dtype=np.int32),
        )

    def copy(self) -> RSCells:
        return RSCells(self.tail.copy(), self.pos.copy(), self.n_hist.copy())

    @property
    def n_seq_max(self) -> int:
        return len(self.tail)

    def has(self, seq: int) -> bool:
        return bool(self.tail[seq] >= 0)

    def users(self, slot: int) -> int:
        """How many sequences read this slot."""
        return int((self.tail == slot).sum())

    def n_used(self) -> int:
        """Slots in use."""
        return len(set(self.tail[self.tail >= 0].tolist()))

    def free_slot(self) -> int:
        """The lowest slot no sequence reads. There are as many slots as sequences, so one is
        always free when a sequence without a private slot asks."""
        used = set(self.tail[self.tail >= 0].tolist())
        for s in range(self.n_seq_max):
            if s not in used:
                return s
        raise RuntimeError("no free recurrent state slot")  # unreachable: slots == sequences

    def detach(self, seq: int) -> None:
        self.tail[seq] = -1
        self.pos[seq] = -1
        self.n_hist[seq] = 0

    def reset(self) -> None:
        self.tail[:] = -1
        self.pos[:] = -1
        self.n_hist[:] = 0
