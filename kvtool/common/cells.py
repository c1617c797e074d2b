"""The engine's KV cell bookkeeping and compaction planner, for tools that simulate them
(defrag-sim replays workloads on them; numpy only), and a model's K/V bytes per cell."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvtool.memory.defrag import apply_defrag, plan_defrag
from kvtool.memory.kv_cells import KVCells

if TYPE_CHECKING:
    from kvtool.kv_dims import KVDims


def read_kv_dims(path: str | Path) -> KVDims:
    """A model's K/V geometry and bytes per cell, from its GGUF header alone. Imported on
    use: the GGUF reader loads torch, which a simulation without a model never needs."""
    from kvtool.kv_dims import read_kv_dims as read

    return read(path)


__all__ = ["KVCells", "apply_defrag", "plan_defrag", "read_kv_dims"]
