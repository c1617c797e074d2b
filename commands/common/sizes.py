"""A context's memory as llama.cpp's logs show it (`llama_kv_cache: size = ...`), for the verbs
that report it (run -v, bench, batched-bench)."""

from __future__ import annotations

import kvtool


def kv_size_lines(ctx: kvtool.Context) -> list[str]:
    """One line per KV cache of the context (a sliding-window model has two): its cells, layers,
    streams, and K and V in MiB with their types."""
    return [
        f"KV cache{' (sliding window)' if kv.swa else ''}: {kv.describe()}"
        for kv in ctx.memory_breakdown().kv
    ]
