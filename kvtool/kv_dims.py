"""The K/V size of one cell for a model, from its GGUF header alone (no weights are read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import KvtoolError
from kvtool.gguf_file import GGUFFile
from kvtool.kernels.kv_quant import kv_type
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

    def cell_bytes(self, type_k: str = "f16", type_v: str = "f16") -> int:
        """Bytes of one cell's K and V rows over all layers in these cache types (f16: llama.cpp's
        default; a quantized type's blocks); KvtoolError for a type whose blocks do not tile a head."""
        try:
            tk, tv = kv_type(type_k), kv_type(type_v)
        except ValueError as e:
            raise KvtoolError(str(e)) from None
        for t, n, what in ((tk, self.head_dim_k, "k"), (tv, self.head_dim_v, "v")):
            if not t.divides(n):  # in the words of the context's refusal (and llama.cpp's)
                raise KvtoolError(
                    f"{what.upper()} cache type {t.name} with block size {t.block} "
                    f"does not divide n_embd_head_{what}={n}"
                )
        return sum(
            h * (tk.row_bytes(self.head_dim_k) + tv.row_bytes(self.head_dim_v)) for h in self.n_head_kv
        )


def read_kv_dims(path: str | Path) -> KVDims:
    """Reads a GGUF header's attention dimensions; raises ModelLoadError on a bad file."""
    hp = HParams.from_gguf(GGUFFile(path), n_vocab=0)
    return KVDims(hp.arch, hp.n_layer, tuple(hp.n_head_kv), hp.head_dim_k, hp.head_dim_v)
