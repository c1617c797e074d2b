"""How much memory a context will take, computed before anything is allocated.

A context's memory is its K/V tensors (per cell, per layer, per stream), its recurrent states
(per sequence), and the buffers one ubatch's forward pass needs (activations, attention scores,
logits). `Context` checks the sum against the memory available and refuses, in one line, a
context that cannot fit (`-c 1000000` on a laptop), instead of being killed by the kernel
minutes later; llama.cpp reports the same three parts when it builds a context.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from kvtool.errors import KvtoolError
from kvtool.memory.hybrid import HybridSpec
from kvtool.memory.kv_cache import KVLayerSpec
from kvtool.memory.recurrent import RecurrentSpec
from kvtool.memory.spec import KVSpec, MemoryParams, MemorySpec, pad

_CELL_META = 32  # bytes of bookkeeping per KV cell and stream (position, shift, sequence bits)
_MiB = 1 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a context needs, by part."""

    kv: int  # K and V tensors
    recurrent: int  # recurrent states (and their rollback snapshots) of every sequence
    compute: int  # one ubatch's activations and attention scores, and the logits

    @property
    def total(self) -> int:
        return self.kv + self.recurrent + self.compute

    def describe(self) -> str:
        parts = (("KV", self.kv), ("recurrent", self.recurrent), ("compute", self.compute))
        return ", ".join(f"{name} {n / _MiB:.1f} MiB" for name, n in parts if n)


def _kv_bytes(spec: KVSpec, p: MemoryParams) -> tuple[int, int]:
    """K/V bytes and the largest number of cells a layer attends over, as KVSpec.build sizes them."""
    n_stream = 1 if p.kv_unified else p.n_seq_max
    size_k = torch.empty(0, dtype=p.type_k).element_size()
    size_v = torch.empty(0, dtype=p.type_v).element_size()
    n_swa_cells = p.n_ctx_seq
    if spec.swa is not None and not p.swa_full:
        want = spec.swa.n_swa * (p.n_seq_max if p.kv_unified else 1) + p.n_ubatch
        n_swa_cells = pad(min(p.n_ctx_seq, want))
    total, n_kv = 0, 0
    for il, s in spec.layers.items():
        cells = n_swa_cells if il in spec.swa_layers else p.n_ctx_seq
        total += n_stream * cells * _layer_bytes(s, size_k, size_v)
        n_kv = max(n_kv, cells)
    n_parts = 2 if spec.swa_layers and len(spec.swa_layers) < len(spec.layers) else 1
    return total + n_parts * n_stream * p.n_ctx_seq * _CELL_META, n_kv


def _layer_bytes(s: KVLayerSpec, size_k: int, size_v: int) -> int:
    return s.n_head_kv * (s.head_dim_k * size_k + s.head_dim_v * size_v)


def _recurrent_bytes(spec: RecurrentSpec, p: MemoryParams) -> int:
    per_seq = 4 * (1 + p.n_rs_seq) * sum(s.numel() for s in spec.layers.values())
    return max(1, p.n_seq_max) * per_seq


def estimate_memory(
    spec: MemorySpec, p: MemoryParams, n_embd: int, n_ff: int, n_head: int, n_vocab: int
) -> MemoryEstimate:
    """The memory a context built from `spec` with `p` needs (weights not included: they are
    loaded already). Compute buffers: a ubatch's residual stream and feed-forward (a few rows of
    n_embd and n_ff floats per token), its attention scores over every cell a stream can hold
    (the reference kernel materializes them), and the logits of n_seq_max outputs."""
    kv = recurrent = n_kv = 0
    kv_spec = spec.attn if isinstance(spec, HybridSpec) else spec if isinstance(spec, KVSpec) else None
    rs_spec = (
        spec.recurrent if isinstance(spec, HybridSpec) else spec if isinstance(spec, RecurrentSpec) else None
    )
    if kv_spec is not None and kv_spec.layers:
        kv, n_kv = _kv_bytes(kv_spec, p)
    if rs_spec is not None:
        recurrent = _recurrent_bytes(rs_spec, p)
    n_tok = p.n_ubatch
    activations = 4 * n_tok * (8 * n_embd + 3 * n_ff)
    scores = 4 * n_tok * max(n_head, 1) * n_kv if n_kv else 0
    logits = 4 * max(p.n_seq_max, 1) * n_vocab
    return MemoryEstimate(kv, recurrent, activations + scores + logits)


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes that can still be allocated on `device`: free GPU memory on CUDA, the system's
    available memory on CPU (psutil: MemAvailable on Linux, the equivalent elsewhere); None
    where that cannot be known (no check then)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return None


def check_fits(estimate: MemoryEstimate, n_ctx: int, device: str | torch.device = "cpu") -> None:
    """Raises KvtoolError (one line) when the context cannot fit in the memory available."""
    free = available_memory(device)
    if free is not None and estimate.total > free:
        raise KvtoolError(
            f"a context of {n_ctx} tokens needs about {estimate.total / _MiB:,.0f} MiB "
            f"({estimate.describe()}) but only {free / _MiB:,.0f} MiB are available: lower -c/--ctx-size"
        )
