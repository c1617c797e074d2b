"""Attention over the per-stream KV layout `[n_stream, n_kv, n_kv_heads, head_dim]`.

The mask carries everything that decides visibility (causality, sequence membership in a
shared stream, sliding windows, empty cells), as llama.cpp's KQ mask does: 0 where a query
sees a key, -inf where it does not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._triton import jit, tl, triton, use_triton

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.0 / math.log(2.0)


def attention_ref(
    q: torch.Tensor,  # [n_stream, n_q, n_head, head_dim]
    k: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim]
    v: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim_v]
    mask: torch.Tensor,  # [n_stream, n_q, n_kv] float, 0 or -inf
    scale: float,
) -> torch.Tensor:  # [n_stream, n_q, n_head, head_dim_v]
    """softmax(scale * q k^T + mask) v per stream, with grouped-query heads.

    A query row that sees no key gives zeros (never NaN).
    """
    S, n_q, n_head, _ = q.shape
    n_head_kv = k.shape[2]
    g = n_head // n_head_kv
    # Query heads that share a KV head become extra query rows of that head: no K/V copies.
    qt = q.float().view(S, n_q, n_head_kv, g, -1).permute(0, 2, 3, 1, 4).reshape(S, n_head_kv, g * n_q, -1)
    kt = k.transpose(1, 2).float()  # [S, Hkv, n_kv, D]
    vt = v.transpose(1, 2).float()  # [S, Hkv, n_kv, Dv]
    empty = torch.isneginf(mask).all(dim=-1, keepdim=True)  # [S, n_q, 1]
    m = mask.masked_fill(empty, 0.0).float()  # [S, n_q, n_kv]
    m = m.unsqueeze(1).expand(S, g, n_q, m.shape[-1]).reshape(S, 1, g * n_q, -1)  # [S, 1, g*n_q, n_kv]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=m, scale=scale)  # [S, Hkv, g*n_q, Dv]
    out = out.view(S, n_head_kv, g, n_q, -1).permute(0, 3, 1, 2, 4).reshape(S, n_q, n_head, -1)
    return out.masked_fill(empty.unsqueeze(-1), 0.0).to(q.dtype)


@jit
def _dot(a, b, F16: tl.constexpr):
    # fp16 operands use the tensor cores; fp32/bf16 operands run in exact fp32 (no tf32), as
    # the reference does (bf16 is upcast: the interpreter mis-computes bf16 dots).
    if F16:
        out = tl.dot(a.to(tl.float16), b.to(tl.float16))
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return out


@jit
def _attention_kernel(
    q_ptr,  # [S, n_q, H, D]
    k_ptr,  # [S, n_kv, Hkv, D]
    v_ptr,  # [S, n_kv, Hkv, Dv]
    mask_ptr,  # [S, n_q, n_kv]
    o_ptr,  # [S, n_q, H, Dv]
    sq_s, sq_m, sq_h,
    sk_s, sk_n, sk_h,
    sv_s, sv_n, sv_h,
    sm_s, sm_m, sm_n,
    so_s, so_m, so_h,
    n_q, n_kv, n_head_kv, group, head_dim, head_dim_v,
    qk_scale,  # scale * log2(e): the softmax runs in base 2
    F16: tl.constexpr,  # all of q, k, v are fp16: dot in fp16; otherwise in fp32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # A program owns one (stream, kv head) and BLOCK_M rows of (query, head in the group):
    # row r is query r // group with head hkv * group + r % group. Packing the group's heads
    # into rows reads each K/V tile once for all of them and fills the tile at decode.
    pid_s = tl.program_id(1)
    s = (pid_s // n_head_kv).to(tl.int64)
    hkv = pid_s % n_head_kv
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    qi = rows // group
    head = hkv * group + rows % group
    row_ok = qi < n_q
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < head_dim
    dv_ok = offs_dv < head_dim_v

    q_ptrs = q_ptr + s * sq_s + qi[:, None] * sq_m + head[:, None] * sq_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    k_base = k_ptr + s * sk_s + hkv * sk_h
    v_base = v_ptr + s * sv_s + hkv * sv_h
    m_base = mask_ptr + s * sm_s + qi[:, None] * sm_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(0, n_kv, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [N]
        n_ok = offs_n < n_kv
        bias_ptrs = m_base + offs_n[None, :] * sm_n
        bias = tl.load(bias_ptrs, mask=row_ok[:, None] & n_ok[None, :], other=float("-inf"))
        bias = bias.to(tl.float32)  # [M, N]
        # Tiles the mask hides entirely (causal future, other sequences, outside a window)
        # cost only the mask read.
        if tl.max(tl.max(bias, axis=1), axis=0) > float("-inf"):
            kt_ptrs = k_base + offs_n[None, :] * sk_n + offs_d[:, None]
            kt = tl.load(kt_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
            qk = _dot(q, kt, F16) * qk_scale + bias * 1.4426950408889634  # [M, N], log2(e)
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            p = tl.math.exp2(qk - m_safe[:, None])  # [M, N]
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_ptrs = v_base + offs_n[:, None] * sv_n + offs_dv[None, :]
            vt = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # [N, Dv]
            acc = acc * alpha[:, None] + _dot(p, vt, F16)
            m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that saw no key stays 0
    o_ptrs = o_ptr + s * so_s + qi[:, None] * so_m + head[:, None] * so_h + offs_dv[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


def attention_triton(
    q: torch.Tensor,  # [n_stream, n_q, n_head, head_dim]
    k: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim]
    v: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim_v]
    mask: torch.Tensor,  # [n_stream, n_q, n_kv] float, 0 or -inf
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [n_stream, n_q, n_head, head_dim_v]
    """Flash attention in Triton with `attention_ref`'s contract (fp32 accumulation).

    `block_m` (rows of query x head-in-group per program) and `block_n` (keys per step)
    override the launch defaults; both must be powers of two >= 16 (tl.dot's minimum).
    """
    assert triton is not None, "attention_triton needs triton"
    n_stream, n_q, n_head, head_dim = q.shape
    _, n_kv, n_head_kv, head_dim_v = v.shape
    assert k.shape == (n_stream, n_kv, n_head_kv, head_dim), (q.shape, k.shape)
    assert v.shape[:3] == k.shape[:3], (k.shape, v.shape)
    assert mask.shape == (n_stream, n_q, n_kv), (mask.shape, q.shape, k.shape)
    assert n_head % n_head_kv == 0, (n_head, n_head_kv)
    assert q.dtype in _DTYPES and k.dtype in _DTYPES and v.dtype in _DTYPES, (q.dtype, k.dtype, v.dtype)
    assert mask.is_floating_point()
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert q.device == k.device == v.device == mask.device
    group = n_head // n_head_kv
    out = torch.empty((n_stream, n_q, n_head, head_dim_v), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    n_rows = n_q * group
    # Decode (one query per stream): 16 rows, the smallest tl.dot tile; prompts: 64.
    block_m = block_m or (16 if n_rows <= 16 else 64)
    block_n = block_n or (64 if max(block_d, block_dv) <= 128 else 32)
    for b in (block_m, block_n):
        assert b >= 16 and b & (b - 1) == 0, f"block sizes must be powers of two >= 16, got {b}"
    f16 = q.dtype == k.dtype == v.dtype == torch.float16
    grid = (triton.cdiv(n_rows, block_m), n_stream * n_head_kv)
    _attention_kernel[grid](
        q, k, v, mask, out,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), mask.stride(1), mask.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        n_q, n_kv, n_head_kv, group, head_dim, head_dim_v,
        scale * _LOG2E,
        F16=f16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=4, num_stages=2 if max(block_d, block_dv) > 128 else 3,
    )  # fmt: skip
    return out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention per stream (see `attention_ref`): Triton on CUDA tensors, the reference elsewhere."""
    if use_triton(q, k, v, mask):
        return attention_triton(q, k, v, mask, scale)
    return attention_ref(q, k, v, mask, scale)
