"""The compiled CPU kernels over every K/V cache type, native and portable builds, against their
torch specifications: the store (kv_quant_cpu.c) is kv_quant.quantize byte for byte; rope +
Hadamard rotation + store (rope_store_cpu.c) has op by op's bits; attention (attention_cpu.c)
over quantized blocks is attention_ref with the query quantized as ggml's flash attention
quantizes it, K and V each of its own type."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtool.kernels import attention_cpu, cpu_lib, rope_store_cpu
from kvtool.kernels.attention_ref import attention_ref
from kvtool.kernels.hadamard import fwht
from kvtool.kernels.kv_quant import C_IDS, KV_TYPES, KVType, quantize
from kvtool.kernels.store_kv import store_kv_ref
from kvtool.models.rope import RopeParams
from tests.kernels.conftest import portable_build
from tests.kernels.test_rope_store_cpu import pair_formula

pytestmark = pytest.mark.skipif(cpu_lib.lib() is None, reason="no C compiler: the kernels are not built")

TYPES = list(KV_TYPES.values())


def values(n: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=gen) * (10.0 ** torch.randint(-3, 3, (n, 1), generator=gen))
    x[0, :32] = 0.0  # an empty block
    x[1, 3] = 1e-7  # a half subnormal of a scale
    return x


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_store_is_the_reference_quantizer(lib: ctypes.CDLL, t: KVType) -> None:
    x = values(9, 128, seed=t.ggml)
    want = quantize(x, t)
    got = torch.zeros_like(want)
    for i in range(len(x)):
        assert lib.kvb_quantize_row(C_IDS[t.name], x[i].data_ptr(), 128, got[i].data_ptr()) == 0
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if t.quantized:
        assert lib.kvb_quantize_row(C_IDS[t.name], x[0].data_ptr(), 48, got[0].data_ptr()) == -1


@pytest.mark.parametrize(
    ("tk", "tv"), [("q8_0", "q8_0"), ("q4_0", "f16"), ("f32", "iq4_nl"), ("q5_1", "q4_1")]
)
@pytest.mark.parametrize(("rot_k", "rot_v"), [(0, 0), (64, 64), (128, 64)])
@pytest.mark.parametrize("q_scale", [1.0, 0.1020620726])  # Gemma's Q scale (1 / sqrt(96)) after RoPE
def test_rope_rotation_and_store_have_op_by_op_bits(
    lib: ctypes.CDLL, tk: str, tv: str, rot_k: int, rot_v: int, q_scale: float
) -> None:
    tk_, tv_ = KV_TYPES[tk], KV_TYPES[tv]
    n, H, Hkv, hd = 5, 4, 2, 128
    rope = RopeParams(n_rot=hd, base=10000.0, neox=True)
    rot = rope.rotation(torch.tensor([0, 3, 17, 250, 4000]))
    gen = torch.Generator().manual_seed(rot_k + rot_v)
    qkv = torch.randn(n, (H + 2 * Hkv) * hd, generator=gen) * 3
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=1)
    cache_k = torch.zeros(16, tk_.width(Hkv * hd), dtype=tk_.dtype)
    cache_v = torch.zeros(16, tv_.width(Hkv * hd), dtype=tv_.dtype)
    rows = torch.tensor([15, 2, 7, 5, 9])
    want_q = pair_formula(q.reshape(n, H, hd), rot, rope).reshape(n, -1) * q_scale
    want_k = pair_formula(k.reshape(n, Hkv, hd), rot, rope).reshape(n, -1)
    want_v = v.clone()
    if rot_k:
        want_q, want_k = fwht(want_q, rot_k), fwht(want_k, rot_k)
    if rot_v:
        want_v = fwht(want_v, rot_v)
    want_kc, want_vc = cache_k.clone(), cache_v.clone()
    store_kv_ref(want_kc, want_k, rows, tk_)
    store_kv_ref(want_vc, want_v, rows, tv_)
    v0 = v.clone()
    assert rope_store_cpu.applies(q, k, v, cache_k, cache_v, tk_, tv_)
    rope_store_cpu.rope_store(
        q, k, v, hd, rot.cs, hd, True, cache_k, cache_v, rows, tk_, tv_, rot_k, rot_v, lib, q_scale
    )
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, v0)
    assert torch.equal(cache_k.view(torch.uint8), want_kc.view(torch.uint8))
    assert torch.equal(cache_v.view(torch.uint8), want_vc.view(torch.uint8))


PAIRS = [(k, v) for k in KV_TYPES for v in ("f16", "q8_0", "q5_1")] + [("f16", v) for v in KV_TYPES]


@pytest.mark.parametrize(("tk", "tv"), PAIRS)
@pytest.mark.parametrize(
    ("S", "n_q", "H", "Hkv", "D"), [(2, 1, 8, 2, 64), (1, 40, 4, 4, 32), (3, 2, 6, 3, 96)]
)
def test_attention_over_blocks_is_the_reference(
    lib: ctypes.CDLL,
    monkeypatch: pytest.MonkeyPatch,
    tk: str,
    tv: str,
    S: int,
    n_q: int,
    H: int,
    Hkv: int,
    D: int,
) -> None:
    tk_, tv_ = KV_TYPES[tk], KV_TYPES[tv]
    gen = torch.Generator().manual_seed(S * 100 + D + n_q)
    n_cells, n_kv = 48, 37
    kv = torch.randn(2, S + 1, n_cells, Hkv, D, generator=gen)
    cache_k, cache_v = quantize(kv[0], tk_), quantize(kv[1], tv_)  # with a spare stream
    k, v = cache_k[1:, :n_kv], cache_v[1:, :n_kv]  # strided views, as the memory gives them
    q = torch.randn(S, n_q, H, D, generator=gen)
    mask = torch.zeros(S, n_q, n_kv)
    mask[torch.rand(S, n_q, n_kv, generator=gen) < 0.4] = float("-inf")
    mask[0, -1] = float("-inf")  # a row that sees nothing: zeros
    monkeypatch.setattr(cpu_lib, "lib", lambda: lib)
    assert attention_cpu.applies(q, k, v, tk_, tv_) == (
        n_q <= attention_cpu.MAX_ROWS or tk_.quantized or tv_.quantized
    )
    got = attention_cpu.attention_cpu(q, k, v, mask, 0.125, tk_, tv_)
    want = attention_ref(q, k, v, mask, 0.125, tk_, tv_)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert torch.equal(got[0, -1], torch.zeros_like(got[0, -1]))


def test_quantized_caches_take_every_row_count_float_ones_a_few() -> None:
    q = torch.randn(1, attention_cpu.MAX_ROWS + 1, 2, 32)
    k = torch.randn(1, 8, 2, 32)
    blocks = quantize(k, KV_TYPES["q8_0"])
    assert not attention_cpu.applies(q, k, k)
    assert attention_cpu.applies(q, blocks, k, KV_TYPES["q8_0"], None)
    assert not attention_cpu.applies(
        q, blocks, k, KV_TYPES["q4_0"].__class__("x", 0, 32, 34, torch.int8), None
    )


@pytest.mark.parametrize("tv", ["q8_0", "q4_1", "iq4_nl"])
@pytest.mark.parametrize(("H", "Hkv", "D", "n_kv"), [(9, 3, 64, 700), (4, 1, 96, 333), (2, 2, 32, 9)])
def test_online_softmax_has_the_bits_of_the_key_by_key_loop(
    tv: str, H: int, Hkv: int, D: int, n_kv: int
) -> None:
    """Over a quantized V the native build computes ggml's online softmax (a running maximum,
    libm's expf of each key's score, S = S * ms + vs, V scaled and added key by key) with its
    weights vectorized; the portable build is that loop key by key in C. Integer Q and K make
    every score exact in both builds, so the outputs must be equal bit for bit: scores from
    far below the maximum (weights in expf's subnormal and underflow ranges) to new maxima at
    any key, hidden keys and a row that sees nothing included."""
    native = cpu_lib.lib()
    assert native is not None and native.kvq_simd() != b"portable"
    gen = torch.Generator().manual_seed(H * n_kv + D)
    q = torch.randint(-6, 7, (2, 1, H, D), generator=gen).float()
    k = torch.randint(-6, 7, (2, n_kv, Hkv, D), generator=gen).to(torch.float16)
    k[0, : n_kv // 3] *= 0  # a run of equal scores
    k[1, n_kv // 2 :: 7] *= 5  # scores far apart: some keys' weights underflow
    v = quantize(torch.randn(2, n_kv, Hkv, D, generator=gen), KV_TYPES[tv])
    mask = torch.zeros(2, 1, n_kv)
    mask[torch.rand(2, 1, n_kv, generator=gen) < 0.3] = float("-inf")
    mask[1, 0, :4] = float("-inf")  # the first keys hidden
    mask[0, 0, -1] = -1.5
    outs = []
    portable = portable_build()
    if portable is None:
        pytest.skip("no portable build")
    for lib in (native, portable):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_lib, "lib", lambda lib=lib: lib)
            outs.append(attention_cpu.attention_cpu(q, k, v, mask, 0.125, None, KV_TYPES[tv]))
    assert outs[0].isfinite().all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("tk", [t.name for t in TYPES if t.quantized])
@pytest.mark.parametrize("D", [64, 96])
def test_a_keys_score_has_the_same_bits_alone_and_in_a_run_of_eight(tk: str, D: int) -> None:
    """Over a quantized K the native build scores eight keys at once where the mask shows all
    eight, one by one elsewhere. Stream 0 holds the keys at cells 0 .. 39 (five runs of eight);
    stream 1 holds the same keys in the same order from cell 1, after a hidden cell, so every
    run of eight there is partly hidden and each key is scored alone. With a quantized V the
    weights and the sum go key by key in order either way, so the two outputs are equal bit for
    bit only if every score is."""
    tk_, tv_ = KV_TYPES[tk], KV_TYPES["q8_0"]
    gen = torch.Generator().manual_seed(D)
    n, H, Hkv = 40, 4, 2
    kv = torch.randn(2, n, Hkv, D, generator=gen) * 2
    cache_k = torch.zeros(2, n + 8, Hkv, tk_.width(D), dtype=tk_.dtype)
    cache_v = torch.zeros(2, n + 8, Hkv, tv_.width(D), dtype=tv_.dtype)
    for s, at in ((0, 0), (1, 1)):
        cache_k[s, at : at + n] = quantize(kv[0], tk_)
        cache_v[s, at : at + n] = quantize(kv[1], tv_)
    q = torch.randn(1, 1, H, D, generator=gen).expand(2, 1, H, D).contiguous()
    mask = torch.full((2, 1, n + 8), float("-inf"))
    mask[0, 0, :n] = 0.0
    mask[1, 0, 1 : n + 1] = 0.0
    got = attention_cpu.attention_cpu(q, cache_k, cache_v, mask, 0.3, tk_, tv_)
    assert got.isfinite().all()
    assert torch.equal(got[0], got[1])
