"""Quantized caches in Triton (TRITON_INTERPRET=1 on CPU) against the torch reference: the store
writes kv_quant.quantize's blocks, attention reads K and V blocks (each of its own type) with the
query quantized as the reference quantizes it, over a mask and over cell metadata, with and
without split keys."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels.attention_ref import attention_cells_ref, attention_ref
from kvtool.kernels.attention_triton import attention_triton
from kvtool.kernels.kv_quant import KV_TYPES, quantize
from kvtool.kernels.store_kv import store_kv_ref, store_kv_triton
from tests.kernels.cells_inputs import CellCase, make_cells

QUANT = [t for t in KV_TYPES.values() if t.quantized]


@pytest.mark.parametrize("t", QUANT, ids=lambda t: t.name)
def test_store_writes_the_reference_blocks(t) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(t.ggml)
    n_stream, n_cells, n_head_kv, hd = 2, 12, 2, 64
    cache = torch.zeros(n_stream, n_cells, n_head_kv, t.width(hd), dtype=torch.uint8)
    rows = cache.view(n_stream * n_cells, -1)  # as the memory stores: stream * n_cells + cell
    src = torch.randn(5, n_head_kv * hd, generator=g) * (10.0 ** torch.randint(-3, 3, (5, 1), generator=g))
    src[0, :32] = 0.0  # an empty block
    idx = torch.tensor([23, 0, 7, 12, 5])
    want = rows.clone()
    store_kv_ref(want, src, idx, t)
    store_kv_triton(rows, src, idx, t)
    if t.name != "iq4_nl":
        assert torch.equal(rows, want)
        return
    # IQ4_NL's scale is a least-squares fit whose sums Triton adds in another order: the same
    # indices, and the scale's fp16 within one unit in the last place
    got_b, want_b = rows.view(-1, 18), want.view(-1, 18)
    assert torch.equal(got_b[:, 2:], want_b[:, 2:])
    d_got, d_want = got_b[:, :2].contiguous().view(torch.int16), want_b[:, :2].contiguous().view(torch.int16)
    assert (d_got.int() - d_want.int()).abs().max() <= 1


TOL = {"rtol": 1e-5, "atol": 1e-5}  # device_checks.py holds the CUDA runs to these too
SHAPES = [(2, 3, 4, 2, 64, 40, None), (1, 20, 2, 1, 32, 70, None), (1, 1, 4, 2, 96, 600, 3)]
SWA_CASE = CellCase("swa", 2, 4, 4, 2, 64, 90, n_seq=2, swa="standard", n_swa=16)
PAIRS = [
    ("q8_0", "q8_0"),
    ("q4_0", "f16"),
    ("q4_1", "q5_1"),
    ("q5_0", "iq4_nl"),
    ("f32", "q4_0"),
    ("iq4_nl", "q8_0"),
]


def operands(tk: str, tv: str, S: int, n_q: int, H: int, Hkv: int, D: int, n_kv: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, S, n_kv, Hkv, D, generator=g)
    a, b = KV_TYPES[tk], KV_TYPES[tv]
    k, v = quantize(kv[0], a), quantize(kv[1], b)
    q = torch.randn(S, n_q, H, D, generator=g)
    return q, k, v, (a if a.quantized else None), (b if b.quantized else None), g


@pytest.mark.parametrize(("tk", "tv"), PAIRS)
@pytest.mark.parametrize(("S", "n_q", "H", "Hkv", "D", "n_kv", "n_split"), SHAPES)
def test_attention_over_blocks(
    tk: str, tv: str, S: int, n_q: int, H: int, Hkv: int, D: int, n_kv: int, n_split: int | None
) -> None:
    q, k, v, a, b, g = operands(tk, tv, S, n_q, H, Hkv, D, n_kv, seed=S + n_q + D)
    mask = torch.zeros(S, n_q, n_kv)
    mask[torch.rand(S, n_q, n_kv, generator=g) < 0.3] = float("-inf")
    got = attention_triton(q, k, v, mask, 0.125, n_split=n_split, tk=a, tv=b)
    want = attention_ref(q, k, v, mask, 0.125, a, b)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize(("tk", "tv"), PAIRS[:4])
def test_cells_attention_over_blocks(tk: str, tv: str) -> None:
    q, k, v, a, b, _ = operands(tk, tv, 2, 4, 4, 2, 64, 90, seed=7)
    cells = make_cells(SWA_CASE, seed=3)
    got = attention_triton(q, k, v, cells, 0.125, tk=a, tv=b)
    want = attention_cells_ref(q, k, v, cells, 0.125, a, b)
    torch.testing.assert_close(got, want, **TOL)
