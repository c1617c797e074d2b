"""K/V cache block formats (kernels/kv_quant.py) against independent references: gguf.quants'
quantizers and dequantizers, a plain-Python port of ggml's IQ4_NL reference quantizer, and the
Hadamard rotation against the explicit matrix llama.cpp builds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from kvtool.kernels.dequant import IQ4_VALUES
from kvtool.kernels.hadamard import fwht
from kvtool.kernels.kv_quant import (
    KV_TYPES,
    blocks_finite,
    dequantize,
    kv_type,
    quantize,
    quantize_q,
    split_affine,
)

QUANT = [t for t in KV_TYPES.values() if t.quantized]
GGUF_QUANT = ["q4_0", "q4_1", "q5_0", "q5_1"]  # gguf-py has their (_ref) quantizers


def rows(n_rows: int, n: int, seed: int) -> np.ndarray:
    """Rows of very different scales, with ties, zeros and a zero block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n)) * 10.0 ** rng.integers(-4, 3, (n_rows, 1))
    x[0, :32] = 0.0
    x[1, :32] = 1.0  # every value the block's maximum
    x[2, 5] = -x[2, :32].__abs__().max() * 1.5  # a negative maximum
    return x.astype(np.float32)


@pytest.mark.parametrize("name", GGUF_QUANT)
def test_quantize_is_gguf_quants_bit_for_bit(name: str) -> None:
    x = rows(64, 256, seed=len(name))
    ours = quantize(torch.from_numpy(x), KV_TYPES[name]).numpy()
    np.testing.assert_array_equal(ours, gguf_quantize(x, T[name.upper()]))


def test_q8_0_is_stored_as_ggml_x86_quantize_row_q8_0() -> None:
    """llama.cpp's CPU set_rows stores q8_0 with from_float, the x86 SIMD quantizer: scale 127 /
    max|x| (the _ref's 1 / (max / 127) differs in its last bit), ties to even (the _ref rounds
    them away from zero); the scale's fp16 is the _ref's. Against that code, in numpy."""
    x = rows(64, 256, seed=8)
    x[3, :4] = [127.0, 0.5, 1.5, -2.5]  # max 127: every other value of the block exactly a tie
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    ints = np.rint(blocks * inv).astype(np.int8)  # rint: ties to even, as _mm256_round_ps
    d = (amax / np.float32(127.0)).astype(np.float16)
    want = np.concatenate([d.view(np.uint8), ints.view(np.uint8)], axis=1).reshape(64, -1)
    ours = quantize(torch.from_numpy(x), KV_TYPES["q8_0"]).numpy()
    np.testing.assert_array_equal(ours, want)
    assert ours[3, 2:6].view(np.int8).tolist() == [127, 0, 2, -2]
    ref = gguf_quantize(x, T.Q8_0)  # the _ref quantizer: the same scales, ties away from zero
    assert ref[3, 2:6].view(np.int8).tolist() == [127, 1, 2, -3]
    np.testing.assert_array_equal(ours.reshape(-1, 34)[:, :2], ref.reshape(-1, 34)[:, :2])


@pytest.mark.parametrize("t", QUANT, ids=lambda t: t.name)
def test_dequantize_is_gguf_quants(t) -> None:  # type: ignore[no-untyped-def]
    x = rows(16, 128, seed=t.ggml)
    blocks = quantize(torch.from_numpy(x), t)
    assert tuple(blocks.shape) == (16, t.row_bytes(128)) and blocks.dtype == torch.uint8
    ref = gguf_dequantize(blocks.numpy(), T(t.ggml))
    np.testing.assert_array_equal(dequantize(blocks, t, 128).numpy(), ref)
    # and the round trip keeps each value within its block's step (where the fp16 scale is normal)
    err = np.abs(ref - x).reshape(-1, 32).max(axis=1)
    amax = np.abs(x).reshape(-1, 32).max(axis=1)
    normal = amax > 0.1
    assert (err <= amax * {"q8_0": 1 / 127}.get(t.name, 1 / 7))[normal].all()


def iq4_nl_ref(x: np.ndarray) -> tuple[float, list[int]]:
    """ggml's quantize_row_iq4_nl_impl for one block of 32 (ntry = -1, no weights given):
    indices for the scale max / -127, then the least-squares scale; as float32 throughout."""
    f = np.float32
    values = [f(v) for v in IQ4_VALUES]

    def best(v: np.float32) -> int:  # best_index_int8
        if v <= values[0]:
            return 0
        if v >= values[15]:
            return 15
        lo, hi = 0, 15
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if v < values[mid]:
                hi = mid
            else:
                lo = mid
        return hi - 1 if v - values[hi - 1] < values[hi] - v else hi

    amax, mx = f(0), f(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < f(1e-15):
        return 0.0, [0] * 32
    inv = f(1) / (mx / values[0])
    idx = [best(inv * v) for v in x]
    sumqx = sumq2 = f(0)
    for v, i in zip(x, idx, strict=True):
        wq = v * v * values[i]
        sumqx = f(sumqx + f(wq * v))
        sumq2 = f(sumq2 + f(wq * values[i]))
    return float(np.float16(sumqx / sumq2 if sumq2 > 0 else 0)), idx


def test_iq4_nl_matches_ggml_reference_quantizer() -> None:
    x = rows(24, 64, seed=7)
    blocks = quantize(torch.from_numpy(x), KV_TYPES["iq4_nl"]).numpy().reshape(-1, 18)
    for b, xb in zip(blocks, x.reshape(-1, 32), strict=True):
        d, idx = iq4_nl_ref(xb)
        assert float(b[:2].view(np.float16)[0]) == d
        got = [int(v) for v in b[2:]]
        assert [q & 15 for q in got] + [q >> 4 for q in got] == idx


def test_rows_of_several_blocks_quantize_block_by_block() -> None:
    x = torch.from_numpy(rows(3, 96, seed=3))
    for t in QUANT:
        whole = quantize(x.view(3, 1, 96), t).reshape(3, -1)
        parts = torch.cat([quantize(x[:, i : i + 32], t) for i in range(0, 96, 32)], dim=1)
        assert torch.equal(whole, parts)


def test_float_types_are_dtypes() -> None:
    x = torch.randn(4, 64)
    for name, dtype in (("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)):
        t = KV_TYPES[name]
        assert quantize(x, t).dtype == dtype and t.width(64) == 64 and t.row_bytes(64) == 64 * dtype.itemsize
        assert torch.equal(dequantize(quantize(x, t), t), x.to(dtype).float())


def test_sizes_and_names() -> None:
    assert {t.name: t.row_bytes(64) for t in QUANT} == {
        "q8_0": 68, "q4_0": 36, "q4_1": 40, "q5_0": 44, "q5_1": 48, "iq4_nl": 36,
    }  # fmt: skip
    assert KV_TYPES["q4_1"].values(40) == 64
    assert not KV_TYPES["q8_0"].divides(16)
    with pytest.raises(ValueError, match="does not divide 16"):
        KV_TYPES["q8_0"].row_bytes(16)
    with pytest.raises(ValueError, match=r"unsupported KV cache type 'q3_k' \(f32, f16, bf16, q8_0"):
        kv_type("q3_k")


def test_query_quantization_is_q8_0_with_x86_rounding() -> None:
    """ggml's x86 quantize_row_q8_0: scale 127 / max|x|, ties to even (one block with a tie)."""
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, *range(28)]], dtype=torch.float32)
    values, s = quantize_q(x, "q8_0")
    assert s is None
    assert values[0, :4].tolist() == [127.0, 0.0, 2.0, -2.0]
    y = torch.from_numpy(rows(8, 64, seed=11))
    values, _ = quantize_q(y, "q8_0")
    # the values are q8_0 blocks' values: requantizing them changes nothing
    again = gguf_dequantize(gguf_quantize(values.numpy(), T.Q8_0), T.Q8_0)
    np.testing.assert_allclose(again, values.numpy(), rtol=1e-6, atol=0)


def test_query_q8_1_sum_and_affine_split() -> None:
    y = torch.from_numpy(rows(4, 64, seed=5))
    _, s = quantize_q(y, "q8_1")
    assert s is not None and s.shape == (4, 2)
    amax = y.view(4, 2, 32).abs().amax(-1)
    ints = torch.round(y.view(4, 2, 32) * torch.where(amax > 0, 127 / amax, 0).unsqueeze(-1))
    want = (amax / 127 * ints.sum(-1)).to(torch.float16).float()
    assert torch.equal(s, want)
    t = KV_TYPES["q5_1"]
    blocks = quantize(y, t)
    scaled, mins = split_affine(blocks, t)
    assert torch.equal(scaled + mins.repeat_interleave(32, dim=1), dequantize(blocks, t))


def test_blocks_finite_looks_at_the_scales() -> None:
    t = KV_TYPES["q4_1"]
    blocks = quantize(torch.randn(2, 64), t)
    assert blocks_finite(blocks, t)
    bad = blocks.clone()
    bad.view(-1, 20)[1, 2:4] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # m = +inf
    assert not blocks_finite(bad, t)
    assert not blocks_finite(torch.tensor([float("nan")]), KV_TYPES["f32"])


def hadamard(n: int) -> np.ndarray:
    """llama.cpp's ggml_gen_hadamard (src/llama-kv-cache.cpp): Sylvester's construction."""
    h = np.zeros((n, n), dtype=np.float64)
    h[0, 0] = 1 / math.sqrt(n)
    s = 1
    while s < n:
        h[s : 2 * s, :s] = h[:s, :s]
        h[:s, s : 2 * s] = h[:s, :s]
        h[s : 2 * s, s : 2 * s] = -h[:s, :s]
        s *= 2
    return h


@pytest.mark.parametrize("n", [64, 128, 256])
def test_fwht_is_the_hadamard_matrix_and_its_own_inverse(n: int) -> None:
    x = torch.randn(5, 2, 512)
    y = fwht(x, n)
    want = (x.double().reshape(-1, n) @ torch.from_numpy(hadamard(n)).T).reshape(x.shape)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fwht(y, n), x, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        fwht(torch.randn(3, 96), 64)


def test_fwht_does_ggml_operations_in_order() -> None:
    """ggml_compute_forward_fwht's float32 steps, written out: scale, then butterflies."""
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    y = x * (np.float32(1) / np.sqrt(np.float32(64)))
    w = 1
    while w < 64:
        for i in range(0, 64, 2 * w):
            u, v = y[i : i + w].copy(), y[i + w : i + 2 * w].copy()
            y[i : i + w], y[i + w : i + 2 * w] = u + v, u - v
        w *= 2
    assert np.array_equal(fwht(torch.from_numpy(x), 64).numpy(), y)
