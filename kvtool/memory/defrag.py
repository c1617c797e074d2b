"""KV compaction planner: pack one stream's used cells to the front (pure numpy on `KVCells`).

The plan is a list of passes; each pass is at most `max_moves` block moves (src, dst, len),
the unit one copy graph executes (ollama's complete defragmentation: plan every move, run
as many passes as needed, instead of stopping at the first graph's limit as llama.cpp's old
defrag_prepare did). Holes in the first `n_used` cells are filled, lowest first, with the
used cells that lie past `n_used`, in their order, so every destination is below `n_used`
and every source at or above it: no move reads a cell another move has written, in any
pass, in any order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool.memory.kv_cells import EMPTY, KVCells

DEFAULT_MAX_MOVES = 256  # block moves per pass (defrag-sim's --max-moves default)
DEFRAG_KINDS = ("none", "threshold", "on-fail")


@dataclass(frozen=True)
class DefragPolicy:
    """When the engine compacts a KV stream. none: never (non-contiguous slots, llama.cpp
    today); threshold: contiguous slots, and each memory update compacts a stream whose holes
    inside its used span exceed `thold` of that span (llama.cpp's old --defrag-thold);
    on-fail: contiguous slots, and a batch that finds none compacts and tries once more
    (ollama). Compaction runs in passes of at most `max_moves` block moves."""

    kind: str = "none"
    thold: float = 0.0
    max_moves: int = DEFAULT_MAX_MOVES

    def __post_init__(self) -> None:
        if self.kind not in DEFRAG_KINDS:
            raise ValueError(f"unknown defrag policy '{self.kind}' (none, threshold=F, on-fail)")
        if self.max_moves < 1:
            raise ValueError("max_moves must be >= 1")

    @property
    def contiguous(self) -> bool:
        """Whether a ubatch needs one run of free cells per stream (the compacting policies)."""
        return self.kind != "none"

    @classmethod
    def parse(cls, text: str, max_moves: int = DEFAULT_MAX_MOVES) -> DefragPolicy:
        """ "none", "threshold=F" (F in [0, 1)) or "on-fail"."""
        kind, _, arg = text.partition("=")
        if kind == "threshold":
            try:
                thold = float(arg)
            except ValueError:
                raise ValueError(f"threshold needs a fraction, as threshold=0.1, got '{text}'") from None
            if not 0.0 <= thold < 1.0:
                raise ValueError(f"the defrag threshold must be in [0, 1), got {thold}")
            return cls("threshold", thold, max_moves)
        if arg:
            raise ValueError(f"unknown defrag policy '{text}' (none, threshold=F, on-fail)")
        return cls(kind, 0.0, max_moves)

    def wants(self, cells: KVCells) -> bool:
        """The threshold check: holes inside the used span above `thold` of the span."""
        if self.kind != "threshold":
            return False
        span = cells.used_max_p1()
        return span > 0 and 1.0 - cells.n_used() / span > self.thold


@dataclass(frozen=True)
class DefragPlan:
    """The moves that pack a stream; `passes[i]` is an int64 array [n_moves, 3] of (src, dst, len)."""

    passes: tuple[np.ndarray, ...]

    @property
    def n_passes(self) -> int:
        return len(self.passes)

    @property
    def n_moves(self) -> int:
        return sum(len(p) for p in self.passes)

    @property
    def n_cells(self) -> int:
        """Cells moved (each one K row and one V row per layer)."""
        return sum(int(p[:, 2].sum()) for p in self.passes)


def plan_defrag(cells: KVCells, max_moves: int) -> DefragPlan:
    """Plans the moves that make the used cells of `cells` a prefix, in passes of at most
    `max_moves` block moves. An already packed stream gets an empty plan."""
    if max_moves < 1:
        raise ValueError("max_moves must be >= 1")
    used = cells.pos != EMPTY  # [size]
    n_used = int(np.count_nonzero(used))
    dst = np.flatnonzero(~used[:n_used])  # holes inside the prefix, lowest first
    src = np.flatnonzero(used[n_used:]) + n_used  # cells to bring in, in their order
    if not len(dst):
        return DefragPlan(())
    # a new block starts wherever the source or the destination stops being consecutive
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    first = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((first, [len(src)])))
    moves = np.stack([src[first], dst[first], lens], axis=1).astype(np.int64)  # [n_moves, 3]
    passes = tuple(moves[i : i + max_moves] for i in range(0, len(moves), max_moves))
    return DefragPlan(passes)


def apply_defrag_moves(cells: KVCells, moves: np.ndarray) -> None:
    """Moves the metadata (pos, sequence set, pending shift) of each (src, dst, len) block and
    empties the sources; the K/V rows must be moved the same way."""
    if not len(moves):
        return
    lens = moves[:, 2]
    step = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)  # offset in its block
    src = np.repeat(moves[:, 0], lens) + step
    dst = np.repeat(moves[:, 1], lens) + step
    for a in (cells.pos, cells.seq, cells.shift):
        a[dst] = a[src]
    cells.pos[src] = EMPTY
    cells.seq[src] = 0
    cells.shift[src] = 0


def apply_defrag(cells: KVCells, plan: DefragPlan) -> None:
    """Applies every pass of `plan`; the next slot search then starts after the packed cells."""
    for moves in plan.passes:
        apply_defrag_moves(cells, moves)
    n_used = cells.n_used()
    cells.head = n_used if n_used < cells.size else 0
