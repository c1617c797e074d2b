"""store_kv: the Triton kernel against the torch reference (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels.store_kv import store_kv_ref, store_kv_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_case(n_rows: int, width: int, n_tokens: int, seed: int, dst_dtype, src_dtype):
    g = torch.Generator().manual_seed(seed)
    dst = torch.randn(n_rows, width, generator=g).to(dst_dtype)  # [n_rows, width]
    src = torch.randn(n_tokens, width, generator=g).to(src_dtype)  # [n_tokens, width]
    idx = torch.randperm(n_rows, generator=g)[:n_tokens]  # [n_tokens] distinct rows, any order
    return dst, src, idx


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16], ids=["src_f32", "src_f16"])
@pytest.mark.parametrize("dst_dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize(
    ("n_rows", "width", "n_tokens", "block"),
    [
        (40, 64, 1, None),  # decode: one token
        (37, 96, 9, None),  # width not a power of two: masked tail
        (64, 200, 64, 64),  # every row written; width split over 4 programs
    ],
)
def test_triton_matches_reference(n_rows, width, n_tokens, block, dst_dtype, src_dtype) -> None:
    dst, src, idx = random_case(n_rows, width, n_tokens, n_rows + width, dst_dtype, src_dtype)
    want = dst.clone()
    store_kv_ref(want, src, idx)
    store_kv_triton(dst, src, idx, block=block)
    untouched = torch.ones(n_rows, dtype=torch.bool).index_fill(0, idx, False)
    assert torch.equal(dst[untouched], want[untouched])
    if dst_dtype == torch.bfloat16 and src_dtype != torch.bfloat16:
        # The interpreter rounds to bf16 toward zero (a GPU rounds to nearest even, as torch
        # does): allow one bf16 ulp.
        torch.testing.assert_close(dst, want, atol=0, rtol=2**-7)
    else:  # a plain copy with at most one rounding to fp16: exact
        assert torch.equal(dst, want)


def test_triton_writes_into_cache_view() -> None:
    # A layer's cache [n_stream, n_cells, n_head_kv, head_dim] viewed as rows stream*n_cells+cell.
    n_stream, n_cells, n_head_kv, head_dim = 3, 10, 2, 16
    cache = torch.zeros(n_stream, n_cells, n_head_kv, head_dim, dtype=torch.float16)
    rows = cache.view(n_stream * n_cells, n_head_kv * head_dim)  # [n_rows, width]
    k_new = torch.randn(4, n_head_kv, head_dim)  # [n_tokens, n_head_kv, head_dim]
    stream, cell = torch.tensor([0, 2, 2, 1]), torch.tensor([9, 0, 5, 3])
    store_kv_triton(rows, k_new.view(4, -1), stream * n_cells + cell)
    torch.testing.assert_close(cache[stream, cell], k_new.half(), atol=0, rtol=0)
    assert cache.abs().sum(dim=(-1, -2)).ne(0).sum() == 4  # nothing else written


def test_triton_strided_rows() -> None:
    # rows padded past the width (row stride > width) on both sides
    dst_full = torch.zeros(12, 48)
    src_full = torch.randn(5, 40)
    dst, src = dst_full[:, :32], src_full[:, 4:36]  # [12, 32], [5, 32]
    idx = torch.tensor([11, 0, 7, 3, 4])
    want = dst_full.clone()
    store_kv_ref(want[:, :32], src, idx)
    store_kv_triton(dst, src, idx)
    assert torch.equal(dst_full, want)


def test_triton_empty_batch_and_bad_inputs() -> None:
    dst = torch.zeros(4, 16)
    store_kv_triton(dst, torch.zeros(0, 16), torch.zeros(0, dtype=torch.int64))
    assert dst.abs().sum() == 0
    with pytest.raises(AssertionError):
        store_kv_triton(dst, torch.zeros(1, 16), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(AssertionError, match="contiguous"):
        store_kv_triton(dst, torch.zeros(16, 2).t(), torch.zeros(2, dtype=torch.int64))  # [2, 16]
