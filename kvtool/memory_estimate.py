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
from kvtool.memory.spec import MemoryParams, MemorySpec

_MiB = 1 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a context needs, by part."""

    kv: int  # K and V tensors and their cells' bookkeeping
    states: int  # recurrent states (and their rollback snapshots) of every sequence, or the like
    compute: int  # one ubatch's activations and attention scores, and the logits

    @property
    def total(self) -> int:
        return self.kv + self.states + self.compute

    def describe(self) -> str:
        parts = (("KV", self.kv), ("states", self.states), ("compute", self.compute))
        return ", ".join(f"{name} {n / _MiB:.1f} MiB" for name, n in parts if n)


def estimate_memory(
    spec: MemorySpec, p: MemoryParams, n_embd: int, n_ff: int, n_head: int, n_vocab: int
) -> MemoryEstimate:
    """The memory a context built from `spec` with `p` needs (weights not included: they are
    loaded already). The memory's own part is what the spec says it will hold; compute buffers:
    a ubatch's residual stream and feed-forward (a few rows of n_embd and n_ff floats per
    token), its attention scores over every cell a stream can hold (the reference kernel
    materializes them), and the logits of n_seq_max outputs."""
    held = spec.memory_breakdown(p)
    n_tok = p.n_ubatch
    activations = 4 * n_tok * (8 * n_embd + 3 * n_ff)
    scores = 4 * n_tok * max(n_head, 1) * held.n_kv
    logits = 4 * max(p.n_seq_max, 1) * n_vocab
    return MemoryEstimate(held.kv_bytes, held.states, activations + scores + logits)


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
