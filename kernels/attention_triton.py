"""Flash attention in Triton over the per-stream KV layout `[n_stream, n_kv, n_kv_heads, head_dim]`,
with `attention_ref`'s contract (kernels/attention_ref.py) and fp32 accumulation; a decode over a
long cache splits its keys (kernels/attention_split.py). Visibility comes as a dense mask (as
llama.cpp's KQ mask, kernels/kq_mask.py) or as the cell metadata it is built from (`Cells`,
kernels/visibility.py), which the kernel evaluates per tile: no n_q x n_kv mask is built or read,
and tiles no query sees are skipped before their keys are loaded.
"""

from __future__ import annotations

import math

import torch

from ._triton import jit, tl, triton
from .attention_split import _NOMINAL_SMS, _attention_reduce_kernel, _n_split, _rows, _store_out
from .kv_quant import C_IDS, KVType, quantize_q
from .kv_triton import iq4_nl_table, load_mins, load_scaled, load_values
from .visibility import SWA_KINDS, Cells, _visible

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.0 / math.log(2.0)


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
    mask_ptr,  # [S, n_q, n_kv] (not read with CELLS)
    cpos_ptr, cseq_ptr,  # [S, n_kv] int64 contiguous: cell positions and sequence bits (CELLS)
    qpos_ptr, qseq_ptr,  # [S, n_q] int64 contiguous: query positions and sequences (CELLS)
    o_ptr,  # [S, n_q, H, Dv]
    m_ptr, l_ptr,  # [n_split, S * Hkv, n_q * group] fp32: each split's running max and sum
    acc_ptr,  # [n_split, S * Hkv, n_q * group, Dv] fp32: each split's unnormalized output
    table_ptr,  # IQ4_NL's values (KT or VT 8)
    qs_ptr,  # [S, n_q, H, n_blocks] fp32: the quantized query's block sums s (an affine K)
    sqs_s, sqs_m, sqs_h,
    sq_s, sq_m, sq_h,
    sk_s, sk_n, sk_h,
    sv_s, sv_n, sv_h,
    sm_s, sm_m, sm_n,
    so_s, so_m, so_h,
    n_q, n_kv, n_head_kv, group, head_dim, head_dim_v,
    kv_per_split,  # keys per program along grid axis 2, a multiple of BLOCK_N
    n_swa,  # the sliding window (CELLS with SWA > 0)
    qk_scale,  # scale * log2(e): the softmax runs in base 2
    F16: tl.constexpr,  # all of q, k, v are fp16: dot in fp16; otherwise in fp32
    SPLIT: tl.constexpr,  # write the partials for _attention_reduce_kernel instead of o
    CELLS: tl.constexpr,  # visibility from cell metadata (else from the mask)
    SWA: tl.constexpr,  # the sliding-window kind, an index in SWA_KINDS (CELLS)
    CAUSAL: tl.constexpr,  # no key after the query's position (CELLS)
    KT: tl.constexpr,  # K's type id (kv_quant.C_IDS; below 3: the float type k_ptr holds)
    VT: tl.constexpr,  # V's
    BBK: tl.constexpr,  # bytes of a K block (a quantized K)
    BBV: tl.constexpr,
    NB: tl.constexpr,  # K blocks per row, padded to a tl.dot size (an affine K)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    pid_sh = tl.program_id(1)
    s, hkv, rows, qi, head, row_ok = _rows(tl.program_id(0), pid_sh, n_q, n_head_kv, group, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < head_dim
    dv_ok = offs_dv < head_dim_v

    q_ptrs = q_ptr + s * sq_s + qi[:, None] * sq_m + head[:, None] * sq_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    offs_b = tl.arange(0, NB)
    b_ok = offs_b < head_dim // 32
    if KT == 5 or KT == 7:
        sums_ptrs = qs_ptr + s * sqs_s + qi[:, None] * sqs_m + head[:, None] * sqs_h + offs_b[None, :]
        q_sums = tl.load(sums_ptrs, mask=row_ok[:, None] & b_ok[None, :], other=0.0)  # [M, NB]
    k_base = k_ptr + s * sk_s + hkv * sk_h
    v_base = v_ptr + s * sv_s + hkv * sv_h
    m_base = mask_ptr + s * sm_s + qi[:, None] * sm_m
    if CELLS:
        qp = tl.load(qpos_ptr + s * n_q + qi, mask=row_ok, other=0)[:, None]  # [M, 1]
        qs = tl.load(qseq_ptr + s * n_q + qi, mask=row_ok, other=0)[:, None]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base 2)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo = tl.program_id(2) * kv_per_split
    hi = tl.minimum(lo + kv_per_split, n_kv)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [N]
        n_ok = offs_n < hi
        if CELLS:
            cp = tl.load(cpos_ptr + s * n_kv + offs_n, mask=n_ok, other=-1)[None, :]  # [1, N]
            cs = tl.load(cseq_ptr + s * n_kv + offs_n, mask=n_ok, other=0)[None, :]
            seen = _visible(cp, cs, qp, qs, n_swa, SWA, CAUSAL) & row_ok[:, None]  # [M, N]
            bias = tl.where(seen, 0.0, float("-inf"))
        else:
            bias_ptrs = m_base + offs_n[None, :] * sm_n
            bias = tl.load(bias_ptrs, mask=row_ok[:, None] & n_ok[None, :], other=float("-inf"))
            bias = bias.to(tl.float32)  # [M, N]
        # Tiles no query sees (causal future, other sequences, outside a window) cost only
        # the metadata (or mask) read: their keys and values are never loaded.
        if tl.max(tl.max(bias, axis=1), axis=0) > float("-inf"):
            k_ok = n_ok[None, :] & d_ok[:, None]
            if KT < 3:
                kt = tl.load(
                    k_base + offs_n[None, :] * sk_n + offs_d[:, None], mask=k_ok, other=0.0
                )  # [D, N]
                qk = _dot(q, kt, F16)
            elif KT == 5 or KT == 7:  # affine: d * q, and the minimums through the query's sums
                k_rows = k_base + offs_n[None, :] * sk_n
                qk = _dot(q, load_scaled(k_rows, offs_d[:, None], k_ok, KT, BBK), False)
                mins = load_mins(k_rows, offs_b[:, None], n_ok[None, :] & b_ok[:, None], BBK)  # [NB, N]
                qk += _dot(q_sums, mins, False)
            else:  # the blocks read as floats, tile by tile
                kt = load_values(k_base + offs_n[None, :] * sk_n, offs_d[:, None], k_ok, table_ptr, KT, BBK)
                qk = _dot(q, kt, False)
            qk = qk * qk_scale + bias * 1.4426950408889634  # [M, N], log2(e)
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
            p = tl.math.exp2(qk - m_safe[:, None])  # [M, N]
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_ok = n_ok[:, None] & dv_ok[None, :]
            if VT < 3:
                vt = tl.load(
                    v_base + offs_n[:, None] * sv_n + offs_dv[None, :], mask=v_ok, other=0.0
                )  # [N, Dv]
            else:
                vt = load_values(v_base + offs_n[:, None] * sv_n, offs_dv[None, :], v_ok, table_ptr, VT, BBV)
            acc = acc * alpha[:, None] + _dot(p, vt, F16)
            m_i = m_new
    if SPLIT:
        part = (tl.program_id(2) * tl.num_programs(1) + pid_sh).to(tl.int64) * n_q * group + rows
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        acc_ptrs = acc_ptr + part[:, None] * head_dim_v + offs_dv[None, :]
        tl.store(acc_ptrs, acc, mask=row_ok[:, None] & dv_ok[None, :])
    else:
        _store_out(o_ptr, s, qi, head, so_s, so_m, so_h, acc, l_i, row_ok, offs_dv, dv_ok)


def attention_triton(
    q: torch.Tensor,  # [n_stream, n_q, n_head, head_dim]
    k: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim]
    v: torch.Tensor,  # [n_stream, n_kv, n_head_kv, head_dim_v]
    seen: torch.Tensor | Cells,  # a mask [n_stream, n_q, n_kv] float, 0 or -inf; or the cells
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    n_split: int | None = None,
    tk: KVType | None = None,
    tv: KVType | None = None,
) -> torch.Tensor:  # [n_stream, n_q, n_head, head_dim_v]
    """Flash attention in Triton with `attention_ref`'s contract (fp32 accumulation). `seen`:
    a dense mask, or the cell metadata ([n_stream, n_kv] cells, [n_stream, n_q] queries) from
    which the kernel decides visibility itself (`attention_cells_ref`'s contract).

    `block_m` (rows of query x head-in-group per program) and `block_n` (keys per step)
    override the launch defaults; both must be powers of two >= 16 (tl.dot's minimum).
    `n_split` caps how many programs share the keys of one row block (1: none; by default a
    decode with few streams splits a long cache, flash-decoding, then merges the splits).
    """
    S, n_q, n_kv = q.shape[0], q.shape[1], k.shape[1]
    if isinstance(seen, Cells):
        assert seen.pos.shape == (S, n_kv) and seen.q_pos.shape == (S, n_q), (seen.pos.shape, q.shape)
        for t in (seen.pos, seen.seq, seen.q_pos, seen.q_seq):
            assert t.dtype == torch.int64 and t.is_contiguous() and t.device == q.device, (t.dtype, t.device)
        return _launch(q, k, v, None, seen, scale, block_m, block_n, n_split, tk, tv)
    assert seen.shape == (S, n_q, n_kv), (seen.shape, q.shape, k.shape)
    assert seen.is_floating_point() and seen.device == q.device
    return _launch(q, k, v, seen, None, scale, block_m, block_n, n_split, tk, tv)


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    cells: Cells | None,
    scale: float,
    block_m: int | None,
    block_n: int | None,
    n_split: int | None,
    tk: KVType | None = None,
    tv: KVType | None = None,
) -> torch.Tensor:
    assert triton is not None, "attention_triton needs triton"
    qk = tk if tk is not None and tk.quantized else None  # the quantized types (None: float)
    qv = tv if tv is not None and tv.quantized else None
    n_stream, n_q, n_head, head_dim = q.shape
    n_kv, n_head_kv = v.shape[1], v.shape[2]
    head_dim_v = qv.values(v.shape[3]) if qv else v.shape[3]
    assert k.shape[:3] == (n_stream, n_kv, n_head_kv), (q.shape, k.shape)
    assert (qk.values(k.shape[3]) if qk else k.shape[3]) == head_dim, (q.shape, k.shape)
    assert v.shape[:3] == k.shape[:3], (k.shape, v.shape)
    assert n_head % n_head_kv == 0, (n_head, n_head_kv)
    assert q.dtype in _DTYPES, q.dtype
    for t, kt in ((k, qk), (v, qv)):
        assert t.dtype == kt.dtype if kt else t.dtype in _DTYPES, (t.dtype, kt)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert q.device == k.device == v.device
    assert n_split is None or n_split >= 1, n_split
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
    n_row_blocks, n_sh = triton.cdiv(n_rows, block_m), n_stream * n_head_kv
    if n_split is None:
        n_sm = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else _NOMINAL_SMS
        n_split = _n_split(n_row_blocks, n_sh, n_kv, n_sm)
    # Whole tiles per split; rounding up may leave fewer splits than asked.
    kv_per_split = triton.cdiv(triton.cdiv(max(n_kv, 1), n_split), block_n) * block_n
    n_split = triton.cdiv(max(n_kv, 1), kv_per_split)
    if n_split > 1:
        m_part = torch.empty((n_split, n_sh, n_rows), dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty((n_split, n_sh, n_rows, head_dim_v), dtype=torch.float32, device=q.device)
    else:  # never read: SPLIT=False writes `out` directly
        m_part = l_part = acc_part = out
    # the inputs a mode does not read are stand-ins (any tensor will do for an unread pointer)
    if cells is None:
        assert mask is not None
        meta, swa, n_swa, causal = (mask, mask, mask, mask), 0, 0, True
    else:
        mask = q.new_empty((0, 0, 0))
        meta = (cells.pos, cells.seq, cells.q_pos, cells.q_seq)
        swa, n_swa, causal = SWA_KINDS.index(cells.swa), cells.n_swa, cells.causal
    # a quantized K: the query as ggml's flash attention quantizes it (its values; an affine K's
    # minimums meet the blocks' sums s); the types' ids and block sizes pick the kernel's loads
    qs = q
    if qk:
        assert qk.vec_dot is not None
        values, sums = quantize_q(q, qk.vec_dot)
        q = values.contiguous()
        qs = q if sums is None else sums.contiguous()
    names = {t.name for t in (qk, qv) if t}
    table = iq4_nl_table(q.device) if "iq4_nl" in names else q  # any tensor for an unread pointer
    types = {
        "KT": C_IDS[qk.name] if qk else 0,
        "VT": C_IDS[qv.name] if qv else 0,
        "BBK": qk.block_bytes if qk else 0,
        "BBV": qv.block_bytes if qv else 0,
        "NB": max(16, triton.next_power_of_2(head_dim // 32)),
    }
    f16 = q.dtype == k.dtype == v.dtype == torch.float16
    _attention_kernel[(n_row_blocks, n_sh, n_split)](
        q, k, v, mask, *meta, out, m_part, l_part, acc_part,
        table, qs, qs.stride(0), qs.stride(1), qs.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0), mask.stride(1), mask.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        n_q, n_kv, n_head_kv, group, head_dim, head_dim_v,
        kv_per_split, n_swa,
        scale * _LOG2E,
        F16=f16, SPLIT=n_split > 1,
        CELLS=cells is not None, SWA=swa, CAUSAL=causal, **types,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        num_warps=4, num_stages=2 if max(block_d, block_dv) > 128 else 3,
    )  # fmt: skip
    if n_split > 1:
        _attention_reduce_kernel[(n_row_blocks, n_sh)](
            m_part, l_part, acc_part, out,
            out.stride(0), out.stride(1), out.stride(2),
            n_q, n_head_kv, group, head_dim_v, n_split,
            BLOCK_M=block_m, BLOCK_DV=block_dv,
        )  # fmt: skip
    return out
