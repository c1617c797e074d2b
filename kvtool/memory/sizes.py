"""What a memory holds, in bytes, by kind (llama.cpp's memory_breakdown, mlx-lm's nbytes).

Every memory kind reports its own `MemoryBreakdown`, and so does every spec for the memory it
would build (before anything is allocated): the context's "does not fit" check, `-v` and the
benchmarks ask, nothing re-derives a memory's layout elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

_MiB = 1024 * 1024


@dataclass(frozen=True)
class KVBufferSize:
    """One KV cache's buffers (one line of llama.cpp's `llama_kv_cache: size = ...` log)."""

    n_cells: int  # per stream
    n_stream: int
    n_layer: int
    type_k: str  # llama.cpp's names: f16, q8_0, ...
    type_v: str
    k: int  # bytes of K, every layer and stream
    v: int
    cells: int  # bytes of the cells' bookkeeping (positions, sequence sets, shifts)
    swa: bool = False  # a sliding-window cache (its cells are reused outside the window)

    @property
    def total(self) -> int:
        return self.k + self.v + self.cells

    def describe(self) -> str:
        """llama.cpp's log line for this cache (its layout, K and V in MiB)."""
        return (
            f"size = {(self.k + self.v) / _MiB:7.2f} MiB ({self.n_cells * self.n_stream:6d} cells, "
            f"{self.n_layer:3d} layers, {self.n_stream:2d} streams), "
            f"K ({self.type_k}): {self.k / _MiB:7.2f} MiB, V ({self.type_v}): {self.v / _MiB:7.2f} MiB"
        )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes a memory holds: its KV caches, its recurrent states, and the most cells one
    attention layer reads per stream (the compute buffers scale with it)."""

    kv: tuple[KVBufferSize, ...] = ()
    recurrent: int = 0  # recurrent states and their rollback snapshots, every sequence
    n_kv: int = 0

    @property
    def kv_bytes(self) -> int:
        return sum(b.total for b in self.kv)

    @property
    def total(self) -> int:
        return self.kv_bytes + self.recurrent

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        """The breakdown of a memory made of both (a composite's parts)."""
        return MemoryBreakdown(
            self.kv + other.kv, self.recurrent + other.recurrent, max(self.n_kv, other.n_kv)
        )
