"""Attention with soft-capped scores (Gemma 2; llama.cpp's attn_soft_cap): each score
s = scale * q.k becomes cap * tanh(s / cap) before the mask and the softmax, as llama.cpp's graph
computes it with flash attention off (scale, multiply by 1 / cap, tanh, multiply by cap).

The contract of `attention_ref` (kernels/attention_ref.py) plus the cap: `attention_softcap_ref` in
torch on any device is the specification; on the CPU a few query rows per stream (decode) take
the compiled kernel (attention_cpu.c, which has the cap), and prompts run by blocks of query rows,
each over the keys its rows see (`KQMask.blocks`), as `attention_blocks` does. The Triton kernel
has no cap: CUDA runs the specification.
"""

from __future__ import annotations

import torch

from . import attention_cpu
from .attention_ref import Q_BLOCK, as_float
from .kq_mask import KQMask
from .kv_quant import KVType
from .visibility import Cells, visibility_mask


def attention_softcap_ref(
    q: torch.Tensor,  # [n_stream, n_q, n_head, head_dim]
    k: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim]
    v: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim_v]
    mask: torch.Tensor,  # [n_stream, n_q, n_kv] float, 0 or -inf
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [n_stream, n_q, n_head, head_dim_v]
    """softmax(cap * tanh(scale * q k^T / cap) + mask) v per stream, grouped-query heads; a row
    that sees no key gives zeros."""
    S, n_q, H, D = q.shape
    Hkv = k.shape[2]
    qg = q.float().reshape(S, n_q, Hkv, H // Hkv, D)
    s = torch.einsum("sqhgd,skhd->shgqk", qg, k.float()) * scale  # [S, Hkv, g, n_q, n_kv]
    s = torch.tanh(s * (1.0 / softcap)) * softcap + mask.float()[:, None, None]
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees nothing: 0/0
    out = torch.einsum("shgqk,skhd->sqhgd", p, v.float()).reshape(S, n_q, H, -1)
    return out.to(q.dtype)


def attention_softcap(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: KQMask | Cells,
    scale: float,
    softcap: float,
    tk: KVType | None = None,
    tv: KVType | None = None,
    compiled: bool = True,
) -> torch.Tensor:
    """`attention_softcap_ref` with the visibility a view gives (a prepared mask, or the cells
    the mask is built from on CUDA), by blocks of query rows over the keys each block sees.
    A quantized K or V (`tk`, `tv`) is read as `attention_ref.as_float` makes it. The compiled CPU
    kernel where it applies, unless `compiled=False` (the backend's choice, kvtool/backend)."""
    if compiled and attention_cpu.applies(q, k, v, tk, tv) and not isinstance(mask, Cells):
        return attention_cpu.attention_cpu(q, k, v, mask.mask, scale, tk, tv, softcap)
    q_dtype = q.dtype
    q, k, v = as_float(q, k, v, tk, tv)
    if isinstance(mask, Cells):
        out = attention_softcap_ref(q, k, v, visibility_mask(mask), scale, softcap)
    elif q.shape[1] <= Q_BLOCK:
        out = attention_softcap_ref(q, k, v, mask.mask, scale, softcap)
    else:
        out = torch.zeros(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
        for q0, q1, k0, k1, part in mask.blocks(Q_BLOCK):
            kv = k[:, k0:k1], v[:, k0:k1]
            out[:, q0:q1] = attention_softcap_ref(q[:, q0:q1], *kv, part.mask, scale, softcap)
    return out if out.dtype == q_dtype else out.to(q_dtype)
