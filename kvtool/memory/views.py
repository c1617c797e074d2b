"""A layer's view of the memory, by the kind the layer computes with: `mctx.layer_view(il)` is
an attention layer's `KVView` or a recurrent layer's `RSView` (memory/base.py's `LayerView`)."""

from __future__ import annotations

from kvtool.memory.base import MemoryContext
from kvtool.memory.kv_cache_context import KVView
from kvtool.memory.recurrent.view import RSView


def kv_view(mctx: MemoryContext, il: int) -> KVView:
    """Attention layer il's view of its KV cache."""
    v = mctx.layer_view(il)
    if not isinstance(v, KVView):
        raise TypeError(f"layer {il} has no KV cache (its view is a {type(v).__name__})")
    return v


def rs_view(mctx: MemoryContext, il: int) -> RSView:
    """Recurrent layer il's view of its states."""
    v = mctx.layer_view(il)
    if not isinstance(v, RSView):
        raise TypeError(f"layer {il} has no recurrent state (its view is a {type(v).__name__})")
    return v
