"""What memory each layer of a model needs (the model declares it; the context builds it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtool.memory.kv_cache import KVLayerSpec
from kvtool.memory.kv_cells import SWAParams


@dataclass(frozen=True)
class MemorySpec:
    kv: dict[int, KVLayerSpec]  # attention layers and the K/V they store
    swa_layers: frozenset[int] = field(default_factory=frozenset)  # the subset with a sliding window
    swa: SWAParams | None = None
