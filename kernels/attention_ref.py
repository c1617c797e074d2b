"""Attention in torch, the specification of every attention kernel (Triton, kernels/attention_triton.py;
the compiled CPU kernel, kernels/attention_cpu.py): softmax(scale * q k^T + mask) v per stream over
the per-stream KV layout `[n_stream, n_kv, n_kv_heads, head_dim]`, a quantized cache read as
ggml's CPU flash attention reads it (`as_float`); on the CPU, prompts by blocks of query rows
over the keys each block sees (`attention_blocks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kq_mask import KQMask, as_kq_mask
from .kv_quant import KVType, dequantize, quantize_q, split_affine
from .visibility import Cells, visibility_mask


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def quantized(t: KVType | None) -> bool:
    return t is not None and t.quantized


def as_float(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tk: KVType | None, tv: KVType | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The operands of a quantized cache as the specification computes with them: K and V
    dequantized, and q quantized to K's dot-product type as ggml's CPU flash attention
    quantizes it (kernels/kv_quant.py): no copy for float caches."""
    if quantized(tk):
        assert tk is not None and tk.vec_dot is not None
        q, s = quantize_q(q, tk.vec_dot)
        if s is None:
            k = dequantize(k, tk, q.shape[-1])
        else:  # an affine K: its blocks' minimums meet the query's block sums, as extra dims
            scaled, mins = split_affine(k, tk)
            q, k = torch.cat([q, s], dim=-1), torch.cat([scaled, mins], dim=-1)
    if quantized(tv):
        assert tv is not None
        v = dequantize(v, tv)
    return q, k, v


def attention_ref(
    q: torch.Tensor,  # [n_stream, n_q, n_head, head_dim]
    k: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim] (a quantized tk: its blocks' bytes)
    v: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim_v] (likewise)
    mask: torch.Tensor | KQMask,  # [n_stream, n_q, n_kv] float, 0 or -inf
    scale: float,
    tk: KVType | None = None,  # a quantized cache's types (None: the float type k and v hold)
    tv: KVType | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:  # [n_stream, n_q, n_head, head_dim_v]
    """softmax(scale * q k^T + mask) v per stream, with grouped-query heads; a quantized K or V
    as `as_float` makes it. `softcap` (Gemma 2; ggml_flash_attn_ext's logit_softcap): each
    score s = scale * q.k becomes softcap * tanh(s / softcap) before the mask, as llama.cpp's
    graph computes it with flash attention off (scale, multiply by 1 / cap, tanh, multiply by cap).

    A query row that sees no key gives zeros (never NaN).
    """
    q_dtype = q.dtype
    q, k, v = as_float(q, k, v, tk, tv)
    if softcap:
        out = _softcapped(q, k, v, mask.mask if isinstance(mask, KQMask) else mask, scale, softcap)
    else:
        out = _sdpa(q, k, v, as_kq_mask(mask), scale)
    return out if out.dtype == q_dtype else out.to(q_dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: KQMask, scale: float) -> torch.Tensor:
    S, n_q, n_head, _ = q.shape
    n_head_kv = k.shape[2]
    g = n_head // n_head_kv
    # Query heads that share a KV head become extra query rows of that head: no K/V copies.
    # With one query per stream (decode) that is a view of q.
    qf = _f32(q)
    if n_q == 1:
        qt = qf.reshape(S, n_head_kv, g, -1)
    else:
        qt = qf.view(S, n_q, n_head_kv, g, -1).permute(0, 2, 3, 1, 4).reshape(S, n_head_kv, g * n_q, -1)
    kt = _f32(k.transpose(1, 2))  # [S, Hkv, n_kv, D]
    vt = _f32(v.transpose(1, 2))  # [S, Hkv, n_kv, Dv]
    out = F.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=m.grouped(g), scale=scale
    )  # [S, Hkv, g*n_q, Dv]
    if n_q == 1:
        out = out.view(S, 1, n_head, -1)
    else:
        out = out.view(S, n_head_kv, g, n_q, -1).permute(0, 3, 1, 2, 4).reshape(S, n_q, n_head, -1)
    if m.empty is not None:
        out = out.masked_fill(m.empty.unsqueeze(-1), 0.0)
    return out


def _softcapped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    S, n_q, H, D = q.shape
    Hkv = k.shape[2]
    qg = q.float().reshape(S, n_q, Hkv, H // Hkv, D)
    s = torch.einsum("sqhgd,skhd->shgqk", qg, k.float()) * scale  # [S, Hkv, g, n_q, n_kv]
    s = torch.tanh(s * (1.0 / softcap)) * softcap + mask.float()[:, None, None]
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees nothing: 0/0
    return torch.einsum("shgqk,skhd->sqhgd", p, v.float()).reshape(S, n_q, H, -1)


Q_BLOCK = 128  # query rows per SDPA call on the CPU for prompts: each reads only the keys it sees


def attention_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | KQMask,
    scale: float,
    tk: KVType | None = None,
    tv: KVType | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`attention_ref` by blocks of Q_BLOCK query rows, each over the range of keys its rows see
    (`KQMask.blocks`): a causal prompt computes about half the scores of one call over all keys.
    The keys left out are hidden from the block's rows, so the result is the same softmax. A
    quantized cache is read once (`as_float`), not once per block."""
    m = as_kq_mask(mask)
    q_dtype = q.dtype
    q, k, v = as_float(q, k, v, tk, tv)
    out = torch.zeros(*q.shape[:3], v.shape[3], dtype=q_dtype, device=q.device)
    for q0, q1, k0, k1, part in m.blocks(Q_BLOCK):
        out[:, q0:q1] = attention_ref(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], part, scale, softcap=softcap)
    return out


def attention_cells_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cells: Cells,
    scale: float,
    tk: KVType | None = None,
    tv: KVType | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`attention_ref` with the mask that `cells` describe (kernels/visibility.py): the spec."""
    return attention_ref(q, k, v, visibility_mask(cells), scale, tk, tv, softcap)
