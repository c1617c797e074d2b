"""store_kv: write new K or V rows into the cache at cell indices (llama.cpp's set_rows)."""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton, use_triton
from .kv_quant import KVType, quantize
from .kv_triton import store_blocks_triton

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def store_kv_ref(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, t: KVType | None = None) -> None:
    """dst[idx[i]] = src[i] for every i, in place; a quantized cache type `t` stores each row
    as its blocks (kernels/kv_quant.py's `quantize`, ggml's rounding).

    dst: [n_rows, width] (the cache of one layer viewed as rows: stream * n_cells + cell; a
    quantized type: each row's blocks, uint8)
    src: [n_tokens, n_values]; idx: [n_tokens] int64, distinct rows.
    """
    if t is not None and t.quantized:
        rows = quantize(src, t)
    else:
        rows = src if src.dtype == dst.dtype else src.to(dst.dtype)
    dst.index_copy_(0, idx, rows)


@jit
def _store_kv_kernel(
    dst_ptr,  # [n_rows, width]
    src_ptr,  # [n_tokens, width]
    idx_ptr,  # [n_tokens] int64
    width,
    stride_dst,
    stride_src,
    BLOCK: tl.constexpr,
):
    # One program per (token, chunk of the row): a plain gather-free scatter of rows.
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < width
    row = tl.load(idx_ptr + i)  # int64: caches can exceed 2**31 elements
    x = tl.load(src_ptr + i.to(tl.int64) * stride_src + cols, mask=keep)
    tl.store(dst_ptr + row * stride_dst + cols, x.to(dst_ptr.dtype.element_ty), mask=keep)


def store_kv_triton(
    dst: torch.Tensor,  # [n_rows, width]
    src: torch.Tensor,  # [n_tokens, width]
    idx: torch.Tensor,  # [n_tokens] int64
    t: KVType | None = None,
    *,
    block: int | None = None,
) -> None:
    """Triton version of `store_kv_ref` (same contract; a quantized `t`: kernels/kv_triton.py).
    `block` overrides the row chunk."""
    assert triton is not None, "store_kv_triton needs triton"
    if t is not None and t.quantized:
        store_blocks_triton(dst, src, idx, t)
        return
    assert dst.dim() == 2 and src.dim() == 2 and idx.dim() == 1
    assert dst.dtype in _DTYPES and src.dtype in _DTYPES, (dst.dtype, src.dtype)
    assert idx.dtype == torch.int64 and idx.is_contiguous()
    n_tokens, width = src.shape
    assert dst.shape[1] == width and idx.shape[0] == n_tokens, (dst.shape, src.shape, idx.shape)
    assert dst.stride(1) == 1 and src.stride(1) == 1, "rows must be contiguous"
    assert dst.device == src.device == idx.device
    if n_tokens == 0:
        return
    block = block or min(1024, triton.next_power_of_2(width))
    grid = (n_tokens, triton.cdiv(width, block))
    _store_kv_kernel[grid](dst, src, idx, width, dst.stride(0), src.stride(0), BLOCK=block)


def store_kv(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, t: KVType | None = None) -> None:
    """dst[idx[i]] = src[i] (quantized to `t`'s blocks): Triton on CUDA tensors, the reference
    elsewhere."""
    if use_triton(dst, src, idx):
        store_kv_triton(dst, src, idx, t)
    else:
        store_kv_ref(dst, src, idx, t)
