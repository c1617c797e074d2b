"""The memory contract (llama.cpp's llama_memory_i): plan a batch, then apply it ubatch by ubatch."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kvtool.batch import BatchAllocator, UBatch


class MemoryStatus(enum.Enum):
    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3


class MemoryContext(Protocol):
    """One planned batch (or update). `apply()` is the only call that mutates the memory."""

    status: MemoryStatus

    def next(self) -> bool: ...
    def apply(self) -> bool: ...
    @property
    def ubatch(self) -> UBatch: ...


class AttentionContext(MemoryContext, Protocol):
    """What an attention layer asks of the memory while a ubatch is computed."""

    def attend(
        self, il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor: ...


class Memory(Protocol):
    def init_batch(self, alloc: BatchAllocator, n_ubatch: int, embd_all: bool) -> MemoryContext: ...
    def init_full(self) -> MemoryContext: ...
    def init_update(self, optimize: bool) -> MemoryContext: ...
    def clear(self, data: bool) -> None: ...
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool: ...
    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...
    def seq_keep(self, seq_id: int) -> None: ...
    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None: ...
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    def can_shift(self) -> bool: ...


class NoUpdate:
    """The update context when nothing is pending."""

    status = MemoryStatus.NO_UPDATE

    def next(self) -> bool:
        return False

    def apply(self) -> bool:
        return True

    @property
    def ubatch(self) -> UBatch:
        raise RuntimeError("an update context has no ubatch")


def pos_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's convention: a negative bound is open ([0, inf))."""
    lo = 0 if p0 < 0 else p0
    hi = 2**31 - 1 if p1 < 0 else p1
    return lo, hi
