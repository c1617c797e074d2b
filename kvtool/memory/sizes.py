"""What a memory holds, in bytes, part by part (llama.cpp's memory_breakdown, mlx-lm's nbytes).

Every memory kind reports its own `MemoryBreakdown`, and so does every spec for the memory it
would build (before anything is allocated): the context's "does not fit" check, `run -v`, the
benchmarks and a server's ledger ask, nothing re-derives a memory's layout elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

_MiB = 1024 * 1024
KV_KINDS = ("attention", "sliding_window")  # parts whose bytes grow with the cells


@dataclass(frozen=True)
class PartSize:
    """One part of a memory: a KV cache (one line of llama.cpp's `llama_kv_cache: size = ...`
    log) or a recurrent memory's states, as allocated (a spec's: as it will be)."""

    part: str  # its name in a composite ("" alone; "base"/"swa", "recurrent"/"attn", "attn.swa")
    kind: str  # "attention" | "sliding_window" | "recurrent" (or a memory kind's own)
    n_cells: int  # per stream (a recurrent memory: its state slots)
    n_stream: int
    used: tuple[int, ...]  # cells in use, per stream (a spec's: none yet)
    n_layer: int
    k: int = 0  # bytes of K, every layer and stream
    v: int = 0
    cells: int = 0  # bytes of the cells' bookkeeping (positions, sequence sets, shifts)
    states: int = 0  # recurrent states and their rollback snapshots, every slot
    type_k: str = ""  # llama.cpp's names: f16, q8_0, ... (a KV cache's)
    type_v: str = ""

    @property
    def nbytes(self) -> int:
        return self.k + self.v + self.cells + self.states

    @property
    def swa(self) -> bool:
        """A sliding-window cache (its cells are reused outside the window)."""
        return self.kind == "sliding_window"

    def describe(self) -> str:
        """llama.cpp's log line for a KV cache (its layout, K and V in MiB)."""
        return (
            f"size = {(self.k + self.v) / _MiB:7.2f} MiB ({self.n_cells * self.n_stream:6d} cells, "
            f"{self.n_layer:3d} layers, {self.n_stream:2d} streams), "
            f"K ({self.type_k}): {self.k / _MiB:7.2f} MiB, V ({self.type_v}): {self.v / _MiB:7.2f} MiB"
        )


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes a memory holds, by part, and the most cells one attention layer reads per stream
    (the compute buffers scale with it)."""

    parts: tuple[PartSize, ...] = ()
    n_kv: int = 0

    @property
    def kv(self) -> tuple[PartSize, ...]:
        """The KV caches."""
        return tuple(p for p in self.parts if p.kind in KV_KINDS)

    @property
    def kv_bytes(self) -> int:
        return sum(p.nbytes for p in self.kv)

    @property
    def states(self) -> int:
        """Bytes of every other part: recurrent states and their snapshots (per sequence, not
        per cell), or whatever a memory kind of its own holds."""
        return sum(p.nbytes for p in self.parts if p.kind not in KV_KINDS)

    @property
    def total(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def named(self, name: str) -> MemoryBreakdown:
        """These parts as the part `name` of a composite."""
        parts = tuple(replace(p, part=f"{name}.{p.part}" if p.part else name) for p in self.parts)
        return MemoryBreakdown(parts, self.n_kv)

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        """The breakdown of a memory made of both (a composite's parts)."""
        return MemoryBreakdown(self.parts + other.parts, max(self.n_kv, other.n_kv))
