"""Attention per stream, the implementation chosen from the operands: Triton on CUDA tensors
(kernels/attention_triton.py), on the CPU the compiled kernel (kernels/attention_cpu.py) where it
applies, torch elsewhere (kernels/attention_ref.py, the specification). Soft-capped scores
(Gemma 2): the compiled kernel has the cap, the Triton kernel has not (CUDA runs the reference)."""

from __future__ import annotations

import torch

from . import attention_cpu
from ._triton import use_triton
from .attention_ref import Q_BLOCK, attention_blocks, attention_cells_ref, attention_ref
from .attention_triton import attention_triton
from .kq_mask import KQMask
from .kv_quant import KVType
from .visibility import Cells


def attention(
    q: torch.Tensor,  # [n_stream, n_q, n_head, head_dim]
    k: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim] (a quantized tk: its blocks' bytes)
    v: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim_v] (likewise)
    seen: torch.Tensor | KQMask | Cells,  # the mask [n_stream, n_q, n_kv], or the cells it is built from
    scale: float,
    tk: KVType | None = None,
    tv: KVType | None = None,
    compiled: bool = True,
    softcap: float = 0.0,
) -> torch.Tensor:  # [n_stream, n_q, n_head, head_dim_v]
    """Attention per stream (see `attention_ref`; tk/tv: a quantized cache's types): Triton on
    CUDA tensors (given cells, the kernel decides visibility from them: no mask is built); on
    the CPU the compiled kernel for a few query rows per stream (decode), and for any number
    over a quantized cache (it reads the blocks), torch's SDPA by blocks of query rows over the
    keys each block sees for more (prompts); cells on the CPU: the reference over the mask they
    describe. `compiled=False`: never the compiled kernel (the backend's choice, kvtool/backend).
    `softcap`: the scores soft-capped (`attention_ref`), never in Triton."""
    if isinstance(seen, Cells):
        if not softcap and use_triton(q, k, v, seen.pos):
            return attention_triton(q, k, v, seen, scale, tk=tk, tv=tv)
        return attention_cells_ref(q, k, v, seen, scale, tk, tv, softcap)
    dense = seen.mask if isinstance(seen, KQMask) else seen
    if not softcap and use_triton(q, k, v, dense):
        return attention_triton(q, k, v, dense, scale, tk=tk, tv=tv)
    if compiled and attention_cpu.applies(q, k, v, tk, tv):
        return attention_cpu.attention_cpu(q, k, v, dense, scale, tk, tv, softcap)
    if q.shape[1] > Q_BLOCK:
        return attention_blocks(q, k, v, seen, scale, tk, tv, softcap)
    return attention_ref(q, k, v, seen, scale, tk, tv, softcap)
