"""The K/V size of one cell for a model, from its GGUF header alone (no weights are read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtool.gguf_file import GGUFFile
from kvtool.models.hparams import HParams


@dataclass(frozen=True)
class KVDims:
    """What one KV cell stores across the model: per layer a K row of n_head_kv x head_dim_k
    and a V row of n_head_kv x head_dim_v. Sliding-window layers count like the others."""

    arch: str
    n_layer: int
    n_head_kv: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int

    def cell_bytes(self, elem_bytes: int = 2) -> int:
        """Bytes of one cell's K and V rows over all layers (2: f16, llama.cpp's default)."""
        return sum(h * (self.head_dim_k + self.head_dim_v) for h in self.n_head_kv) * elem_bytes


def read_kv_dims(path: str | Path) -> KVDims:
    """Reads a GGUF header's attention dimensions; raises ModelLoadError on a bad file."""
    hp = HParams.from_gguf(GGUFFile(path), n_vocab=0)
    return KVDims(hp.arch, hp.n_layer, tuple(hp.n_head_kv), hp.head_dim_k, hp.head_dim_v)
