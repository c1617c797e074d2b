"""Quantized K/V caches in Triton: rows stored as GGUF blocks (store_blocks_triton, the bytes of
kernels/kv_quant.py's `quantize` but for IQ4_NL's scale, whose least-squares sums Triton adds in
another order) and a tile of a cache read as floats, block by block, inside the attention kernel
(`load_values`): the cache is never dequantized as a whole.

Type ids are kv_quant.C_IDS (0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0, 5 q4_1, 6 q5_0, 7 q5_1, 8
iq4_nl); a block of 32 values holds an fp16 scale d (and an fp16 minimum m for q4_1/q5_1), q5's
fifth bits as a little-endian uint32, then its quants (4-bit ones two to a byte, element j in
the low nibble and j + 16 in the high one).
"""

from __future__ import annotations

import functools

import torch

from ._triton import jit, tl, triton
from .dequant import IQ4_VALUES
from .kv_quant import C_IDS, KVType


@functools.cache
def iq4_nl_table(device: torch.device) -> torch.Tensor:
    """IQ4_NL's 16 values, float32, for the kernels' lookups: made once per device (a copy from
    the host during a decode step would break its CUDA graph's capture, and cost a sync)."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=device)


@jit
def _half(p, ok):
    # the fp16 at byte pointer(s) p (where ok), as float32
    lo = tl.load(p, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@jit
def _quants(blk, j, ok, TYPE: tl.constexpr):
    # the unsigned quant of element j of blocks blk (4-bit, or 5-bit for q5_0/q5_1); q8_0: int8
    if TYPE == 3:
        q = tl.load(blk + 2 + j, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.int32)
    else:
        if TYPE == 5:  # q4_1: d, m, quants
            at = 4
        elif TYPE == 6:  # q5_0: d, fifth bits, quants
            at = 6
        elif TYPE == 7:  # q5_1: d, m, fifth bits, quants
            at = 8
        else:  # q4_0, iq4_nl: d, quants
            at = 2
        byte = tl.load(blk + at + j % 16, mask=ok, other=0).to(tl.int32)
        q = (byte >> ((j // 16) * 4)) & 15
        if TYPE == 6 or TYPE == 7:
            bits = tl.load(blk + (at - 4) + j // 8, mask=ok, other=0).to(tl.int32)
            q = q | (((bits >> (j % 8)) & 1) << 4)
    return q


@jit
def load_values(row_ptr, col, ok, table_ptr, TYPE: tl.constexpr, BB: tl.constexpr):
    """Values at element `col` of the rows at byte pointers `row_ptr` (a tile of any shape;
    `ok` masks it) of a cache of quantized TYPE, whose blocks are BB bytes, as float32."""
    blk = row_ptr + (col // 32) * BB
    j = col % 32
    d = _half(blk, ok)
    q = _quants(blk, j, ok, TYPE)
    if TYPE == 8:  # iq4_nl: d * value
        x = d * tl.load(table_ptr + q, mask=ok, other=0.0)
    elif TYPE == 4:  # q4_0: d * (q - 8)
        x = d * (q - 8).to(tl.float32)
    elif TYPE == 6:  # q5_0: d * (q - 16)
        x = d * (q - 16).to(tl.float32)
    elif TYPE == 3:  # q8_0: d * q
        x = d * q.to(tl.float32)
    else:  # q4_1, q5_1: d * q + m
        x = d * q.to(tl.float32) + _half(blk + 2, ok)
    return x


@jit
def load_scaled(row_ptr, col, ok, TYPE: tl.constexpr, BB: tl.constexpr):
    """An affine type's (q4_1, q5_1) d * q without its minimum: the minimum meets the query's
    block sums apart, as ggml's q8_1 dot product adds it."""
    blk = row_ptr + (col // 32) * BB
    return _half(blk, ok) * _quants(blk, col % 32, ok, TYPE).to(tl.float32)


@jit
def load_mins(row_ptr, b, ok, BB: tl.constexpr):
    """An affine type's block minimums: block b of the rows at row_ptr, float32."""
    return _half(row_ptr + b * BB + 2, ok)


@jit
def _rint(y):
    # round to nearest, ties to even (x86's _mm256_round_ps), exact: y - floor(y) is exact in float32
    f = tl.floor(y)
    r = y - f
    odd = (f.to(tl.int32) & 1) == 1
    return f + tl.where((r > 0.5) | ((r == 0.5) & odd), 1.0, 0.0)


@jit
def _signed_max(lo, hi, offs):
    # the value of largest magnitude of the block (lo: elements 0-15, hi: 16-31), the first on a tie
    amax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
    first = tl.minimum(
        tl.min(tl.where(tl.abs(lo) == amax, offs, 64), axis=0),
        tl.min(tl.where(tl.abs(hi) == amax, offs + 16, 64), axis=0),
    )
    return tl.sum(tl.where(offs == first, lo, 0.0), axis=0) + tl.sum(
        tl.where(offs + 16 == first, hi, 0.0), axis=0
    )


@jit
def _inverse(d):
    # ggml's d ? 1.0f / d : 0.0f
    return tl.where(d != 0.0, 1.0 / tl.where(d != 0.0, d, 1.0), 0.0)


@jit
def _put_half(p, x):
    bits = x.to(tl.float16).to(tl.uint16, bitcast=True)
    tl.store(p, (bits & 255).to(tl.uint8))
    tl.store(p + 1, (bits >> 8).to(tl.uint8))


@jit
def _nearest_iq4(a, table_ptr):
    # ggml's best_index_int8: the nearest of the 16 values, the upper one on a tie
    t = tl.arange(0, 16)
    vals = tl.load(table_ptr + t)
    mu = tl.sum((a[:, None] >= vals[None, :]).to(tl.int32), axis=1)  # values <= a
    mu = tl.minimum(tl.maximum(mu, 1), 15)
    lo = tl.load(table_ptr + mu - 1)
    hi = tl.load(table_ptr + mu)
    return tl.where(a - lo < hi - a, mu - 1, mu)


@jit
def _store_blocks_kernel(
    dst_ptr,  # [n_rows, row_bytes] uint8
    src_ptr,  # [n_tokens, width] float
    idx_ptr,  # [n_tokens] int64
    table_ptr,  # IQ4_NL's values (float32)
    stride_dst,
    stride_src,
    TYPE: tl.constexpr,
    BB: tl.constexpr,
):
    # One program per (token, block of 32 values): ggml's reference quantizer of the block.
    i = tl.program_id(0)
    b = tl.program_id(1)
    offs = tl.arange(0, 16)
    src = src_ptr + i.to(tl.int64) * stride_src + b * 32
    lo = tl.load(src + offs).to(tl.float32)  # elements 0-15: low nibbles
    hi = tl.load(src + 16 + offs).to(tl.float32)  # 16-31: high nibbles
    out = dst_ptr + tl.load(idx_ptr + i) * stride_dst + b * BB
    if TYPE == 3:  # q8_0, as ggml's x86 quantize_row_q8_0 (llama.cpp's CPU set_rows)
        amax = tl.maximum(tl.max(tl.abs(lo), axis=0), tl.max(tl.abs(hi), axis=0))
        inv = tl.where(amax != 0.0, 127.0 / tl.where(amax != 0.0, amax, 1.0), 0.0)
        _put_half(out, amax / 127.0)
        tl.store(out + 2 + offs, _rint(lo * inv).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True))
        tl.store(out + 18 + offs, _rint(hi * inv).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True))
    elif TYPE == 4:  # q4_0
        _sym_block(lo, hi, offs, out, 8)
    elif TYPE == 6:  # q5_0
        _sym_block(lo, hi, offs, out, 16)
    elif TYPE == 5:  # q4_1
        _affine_block(lo, hi, offs, out, 16)
    elif TYPE == 7:  # q5_1
        _affine_block(lo, hi, offs, out, 32)
    else:  # iq4_nl: indices for the scale max / -127, then the least-squares scale
        mx = _signed_max(lo, hi, offs)
        amax = tl.abs(mx)
        inv = _inverse(mx / -127.0)
        i0 = _nearest_iq4(inv * lo, table_ptr)
        i1 = _nearest_iq4(inv * hi, table_ptr)
        v0 = tl.load(table_ptr + i0)
        v1 = tl.load(table_ptr + i1)
        w0, w1 = lo * lo * v0, hi * hi * v1
        sumqx = tl.sum(w0 * lo, axis=0) + tl.sum(w1 * hi, axis=0)
        sumq2 = tl.sum(w0 * v0, axis=0) + tl.sum(w1 * v1, axis=0)
        d = tl.where(sumq2 > 0.0, sumqx / tl.where(sumq2 > 0.0, sumq2, 1.0), 0.0)
        empty = amax < 1e-15
        d = tl.where(empty, 0.0, d)
        i0 = tl.where(empty, 0, i0)
        i1 = tl.where(empty, 0, i1)
        _put_half(out, d)
        tl.store(out + 2 + offs, (i0 | (i1 << 4)).to(tl.uint8))


@jit
def _sym_block(lo, hi, offs, out, HALF: tl.constexpr):
    # q4_0 (HALF 8), q5_0 (16): d = max / -HALF, q = MIN(2 HALF - 1, (int8_t)(x / d + HALF + 0.5))
    d = _signed_max(lo, hi, offs) / -HALF
    inv = _inverse(d)
    q0 = tl.minimum((lo * inv + (HALF + 0.5)).to(tl.int32), 2 * HALF - 1)
    q1 = tl.minimum((hi * inv + (HALF + 0.5)).to(tl.int32), 2 * HALF - 1)
    _put_half(out, d)
    if HALF == 16:  # the fifth bits, then the nibbles
        _store_high_bits(out + 2, q0, q1, offs)
        tl.store(out + 6 + offs, ((q0 & 15) | ((q1 & 15) << 4)).to(tl.uint8))
    else:
        tl.store(out + 2 + offs, (q0 | (q1 << 4)).to(tl.uint8))


@jit
def _affine_block(lo, hi, offs, out, LEVELS: tl.constexpr):
    # q4_1 (LEVELS 16), q5_1 (32): d = (max - min) / (LEVELS - 1), m = min, q = (x - m) / d + 0.5
    # (q4_1 caps it at 15; q5_1's stays below 32 as ggml's (uint8_t) cast assumes)
    mn = tl.minimum(tl.min(lo, axis=0), tl.min(hi, axis=0))
    d = (tl.maximum(tl.max(lo, axis=0), tl.max(hi, axis=0)) - mn) / (LEVELS - 1.0)
    inv = _inverse(d)
    q0 = tl.minimum(((lo - mn) * inv + 0.5).to(tl.int32), LEVELS - 1)
    q1 = tl.minimum(((hi - mn) * inv + 0.5).to(tl.int32), LEVELS - 1)
    _put_half(out, d)
    _put_half(out + 2, mn)
    if LEVELS == 32:
        _store_high_bits(out + 4, q0, q1, offs)
        tl.store(out + 8 + offs, ((q0 & 15) | ((q1 & 15) << 4)).to(tl.uint8))
    else:
        tl.store(out + 4 + offs, (q0 | (q1 << 4)).to(tl.uint8))


@jit
def _store_high_bits(p, q0, q1, offs):
    # q5's fifth bits, bit j of a little-endian uint32 for element j: byte k holds elements 8k..8k+7
    h0 = ((q0 >> 4) & 1) << (offs % 8)  # elements 0-15 -> bytes 0, 1
    h1 = ((q1 >> 4) & 1) << (offs % 8)  # elements 16-31 -> bytes 2, 3
    tl.store(p + 0, tl.sum(tl.where(offs < 8, h0, 0), axis=0).to(tl.uint8))
    tl.store(p + 1, tl.sum(tl.where(offs >= 8, h0, 0), axis=0).to(tl.uint8))
    tl.store(p + 2, tl.sum(tl.where(offs < 8, h1, 0), axis=0).to(tl.uint8))
    tl.store(p + 3, tl.sum(tl.where(offs >= 8, h1, 0), axis=0).to(tl.uint8))


def store_blocks_triton(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, t: KVType) -> None:
    """dst[idx[i]] = the blocks of src[i] in quantized type t (store_kv_ref's contract)."""
    assert triton is not None, "store_blocks_triton needs triton"
    assert t.quantized and dst.dtype == torch.uint8 and src.dim() == 2 and idx.dtype == torch.int64
    n_tokens, width = src.shape
    assert dst.shape[1] == t.row_bytes(width) and idx.shape == (n_tokens,) and idx.is_contiguous()
    assert dst.stride(1) == 1 and src.stride(1) == 1, "rows must be contiguous"
    if n_tokens == 0:
        return
    grid = (n_tokens, width // 32)
    table = iq4_nl_table(src.device) if t.name == "iq4_nl" else src  # any tensor for an unread pointer
    _store_blocks_kernel[grid](
        dst, src, idx, table, dst.stride(0), src.stride(0), TYPE=C_IDS[t.name], BB=t.block_bytes
    )
