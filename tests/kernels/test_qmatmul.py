"""kernels/qmatmul: the compiled block matmul (its AVX2 build and its portable C build) against
the torch specification, and the specification's activation quantization against gguf's."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvtool.kernels import cpu_lib, qmatmul
from kvtool.kernels.dequant import Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0
from kvtool.kernels.qmatmul import LOWBIT_TYPES
from tests.helpers.lowbit import random_blocks

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the kernel is not built")


def weight(qtype: int, n_out: int, k: int, seed: int) -> torch.Tensor:
    """Raw blocks [n_out, row bytes] of a random weight of type `qtype`."""
    rng = np.random.default_rng(seed)
    if qtype in LOWBIT_TYPES:  # random blocks with finite small scales
        return torch.from_numpy(random_blocks(qtype, n_out, k, rng))  # type: ignore[arg-type]
    if qtype in (Q4_K, Q5_K):  # gguf cannot quantize K-quants: random blocks with small scales
        b = rng.integers(0, 256, size=(n_out * k // 256, 144 if qtype == Q4_K else 176), dtype=np.uint8)
        b[:, 0:4] = rng.uniform(1e-3, 4e-3, size=(b.shape[0], 2)).astype(np.float16).view(np.uint8)
        return torch.from_numpy(b).reshape(n_out, -1)
    if qtype == Q6_K:  # random bits, int8 scales of both signs, d last
        b = rng.integers(0, 256, size=(n_out * k // 256, 210), dtype=np.uint8)
        b[:, 208:210] = rng.uniform(1e-4, 4e-4, size=(b.shape[0], 1)).astype(np.float16).view(np.uint8)
        return torch.from_numpy(b).reshape(n_out, -1)
    x = (rng.standard_normal((n_out, k)) * 0.1).astype(np.float32)
    return torch.from_numpy(quantize(x, GGMLQuantizationType(qtype)))


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize("n", [1, 2, 4, 5, 9, 19])
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_the_specification(lib: ctypes.CDLL, qtype: int, n: int, threads: int) -> None:
    k = 512
    shapes = [(40, k), (24, k), (72, k)]  # stacked like Q, K and V, widths not multiples of 16
    raws = [weight(qtype, s[0], k, i) for i, s in enumerate(shapes)]
    x = torch.randn(n, k) * torch.logspace(-2, 1, k)  # blocks of very different scales
    x[0, :32] = 0.0  # an all-zero block: scale 0
    lib.kvq_set_threads(threads)
    try:
        y = qmatmul.QWeight(raws, qtype, shapes)(x, lib)
    finally:
        lib.kvq_set_threads(torch.get_num_threads())
    want = torch.cat([qmatmul.qmatmul_ref(x, r, qtype, s) for r, s in zip(raws, shapes, strict=True)], 1)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K])
def test_a_row_gives_the_same_bits_alone_or_among_others(lib: ctypes.CDLL, qtype: int) -> None:
    """Rows go through a one-row, a four-row or (AVX2) an eight-row group kernel depending on
    how many share a call; each sums in the same order, so a sequence's logits do not depend on
    which other sequences are batched with it."""
    k = 512
    w = qmatmul.QWeight([weight(qtype, 48, k, 3)], qtype, [(48, k)])
    x = torch.randn(19, k) * torch.logspace(-2, 1, k)  # two groups of 8, then 3 rows
    together = w(x, lib)
    for i in range(x.shape[0]):
        assert torch.equal(w(x[i : i + 1], lib)[0], together[i]), i
    assert torch.equal(w(x[3:15], lib), together[3:15])  # a group, then 4 rows, at other offsets


@pytest.mark.parametrize("qtype", [Q4_0, Q5_0, Q8_0, Q4_K, Q6_K])
@pytest.mark.parametrize("n", [2, 6, 27, 32])
@pytest.mark.parametrize("threads", [1, 3])
def test_pairs_of_rows_give_each_row_its_bits_alone(
    lib: ctypes.CDLL, qtype: int, n: int, threads: int
) -> None:
    """On AVX-512 VNNI, 2 to 32 rows go two a vector through the pair kernels (qrows_pair.c), in
    groups of up to 4 pairs, 4 weight rows a pass for the 32-element formats: stacked weights of
    13 and 22 rows straddle the passes, and the pool's chunks of the quantization hold several
    pairs at one thread. Each row keeps the one-row kernel's bits."""
    k = 512
    shapes = [(13, k), (22, k)]
    w = qmatmul.QWeight([weight(qtype, s[0], k, 20 + i) for i, s in enumerate(shapes)], qtype, shapes)
    x = torch.randn(n, k) * torch.logspace(-2, 1, k)
    x[n - 1, 32:64] = 0.0  # an all-zero block: scale 0
    lib.kvq_set_threads(threads)
    try:
        together = w(x, lib)
        for i in range(n):
            assert torch.equal(w(x[i : i + 1], lib)[0], together[i]), i
    finally:
        lib.kvq_set_threads(torch.get_num_threads())


def test_avx512_vnni_builds_have_the_pair_kernels(lib: ctypes.CDLL) -> None:
    paired = {t for t in (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, *LOWBIT_TYPES) if lib.kvq_pair_format(t)}
    want = {Q4_0, Q5_0, Q8_0, Q4_K, Q6_K} if lib.kvq_simd() == b"avx512-vnni" else set()
    assert paired == want


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize("n", [33, 70])
def test_many_rows_match_the_specification(lib: ctypes.CDLL, qtype: int, n: int) -> None:
    """From 33 rows (prompts) the panel kernel takes over where the build has it: weights
    unpacked 8 or 16 rows at a time, stacked weights whose row counts are not multiples of that
    straddling panels."""
    k = 512
    shapes = [(36, k), (20, k), (75, k)]
    raws = [weight(qtype, s[0], k, 10 + i) for i, s in enumerate(shapes)]
    x = torch.randn(n, k) * torch.logspace(-2, 1, k)
    x[1, 64:96] = 0.0
    y = qmatmul.QWeight(raws, qtype, shapes)(x, lib)
    want = torch.cat([qmatmul.qmatmul_ref(x, r, qtype, s) for r, s in zip(raws, shapes, strict=True)], 1)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K])
def test_many_rows_give_a_row_the_same_bits_wherever_it_sits(lib: ctypes.CDLL, qtype: int) -> None:
    """The panel kernel sums each row alone in block order: its tiles of 4 rows and the rows
    left over compute alike, so a prompt row does not depend on the rows around it."""
    k = 512
    w = qmatmul.QWeight([weight(qtype, 45, k, 5)], qtype, [(45, k)])
    x = torch.randn(70, k) * torch.logspace(-2, 1, k)
    together = w(x, lib)
    assert torch.equal(w(x[5:43], lib), together[5:43])  # 38 rows, shifted against the tiles
    assert torch.equal(w(x[33:], lib), together[33:])


def test_every_build_has_the_panel_kernel(lib: ctypes.CDLL) -> None:
    formats = (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)
    if lib is not qmatmul._lib():  # the portable build: plain C panels, no float copy of a weight
        assert all(lib.kvq_panels(t) for t in (*formats, *LOWBIT_TYPES))
        return
    assert not any(lib.kvq_panels(t) for t in LOWBIT_TYPES)  # the AVX2 panels: not these formats yet
    flags = set(cpu_lib._cpu_flags().split())
    if flags >= {"avx512f", "avx512bw", "avx512_vnni"}:  # built with -march=native
        assert all(lib.kvq_panels(t) for t in formats)
    elif flags >= {"avx2", "fma", "f16c"}:  # 8-bit weights would overflow vpmaddubsw's int16 sums
        assert all(lib.kvq_panels(t) for t in formats if t != Q8_0) and not lib.kvq_panels(Q8_0)


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, *LOWBIT_TYPES])
def test_portable_panels_give_the_row_kernels_bits(lib: ctypes.CDLL, qtype: int) -> None:
    """Without AVX2 (qpanel_c.c) the panel kernel adds each row's block sums in the row kernels'
    order: a prompt row has the bits the same row gets alone."""
    if lib is qmatmul._lib() and cpu_lib._cpu_flags() and "avx2" in cpu_lib._cpu_flags().split():
        pytest.skip("the AVX2 panels add in another order (the test above bounds them)")
    k = 512
    w = qmatmul.QWeight([weight(qtype, 21, k, 6)], qtype, [(21, k)])
    x = torch.randn(40, k) * torch.logspace(-2, 1, k)
    together = w(x, lib)
    for i in (0, 7, 39):
        assert torch.equal(w(x[i : i + 1], lib)[0], together[i]), i


def test_strided_rows_and_the_portable_build_agree(lib: ctypes.CDLL) -> None:
    raw = weight(Q4_1, 32, 64, 7)
    x = torch.randn(6, 128)[:, :64]  # rows 128 floats apart
    y = qmatmul.QWeight([raw], Q4_1, [(32, 64)])(x, lib)
    torch.testing.assert_close(y, qmatmul.qmatmul_ref(x, raw, Q4_1, (32, 64)), rtol=1e-5, atol=1e-5)


def test_activation_quantization_is_ggml_q8_0() -> None:
    x = torch.randn(4, 256) * 3
    q, d = qmatmul.quantize_q8_0_ref(x)
    blocks = quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(-1, 34)
    want_q = blocks[:, 2:].view(np.int8).astype(np.float32).reshape(4, -1, 32)
    assert np.array_equal(q.numpy(), want_q)  # ties (x * id exactly .5) do not occur here
    want_d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(4, -1, 1)
    assert np.array_equal(d.numpy(), want_d)


def test_q8_1_activations_carry_the_scaled_sum() -> None:
    x = torch.randn(3, 128)
    q, d, s = qmatmul.quantize_q8_1_ref(x)
    assert torch.equal(q, qmatmul.quantize_q8_0_ref(x)[0]) and torch.equal(d, qmatmul.quantize_q8_0_ref(x)[1])
    amax = x.reshape(3, -1, 32).abs().amax(-1, keepdim=True)
    want = (amax.double() / 127 * q.sum(-1, keepdim=True).double()).numpy()
    np.testing.assert_allclose(s.numpy(), want, rtol=2.0**-11)  # a half's rounding


def test_q8_K_activations_scale_by_the_largest_element_with_its_sign() -> None:
    x = torch.randn(2, 512) * torch.logspace(-2, 1, 512)
    x[1, 256:] = 0.0  # an all-zero block
    x[0, 7] = -50.0  # the largest |x| of block 0 is negative, of block 1 positive: either way its
    x[0, 300] = 40.0  # q is -127, and d has the opposite sign
    q, d = qmatmul.quantize_q8_K_ref(x)
    assert q[0, 0, 7] == -127 and q[0, 1, 300 - 256] == -127 and float(d[0, 1]) < 0 < float(d[0, 0])
    assert q.abs().max() <= 127 and float(d[1, 1]) == 0.0 and not q[1, 1].any()
    err = (q * d - x.reshape(2, -1, 256)).abs()
    assert bool((err <= d.abs() / 2 * (1 + 1e-6)).all())  # each value within half a step


def test_bad_calls_are_refused() -> None:
    raw = weight(Q4_0, 16, 64, 0)
    with pytest.raises(ValueError, match="width"):
        qmatmul.QWeight([raw], Q4_0, [(16, 64)])(torch.randn(1, 32))
    with pytest.raises(ValueError, match="no qmatmul kernel"):
        qmatmul.QWeight([raw], Q4_K, [(16, 64)])  # Q4_K rows are 256-element super-blocks
    with pytest.raises(ValueError, match="bytes"):
        qmatmul.QWeight([raw[:8]], Q4_0, [(16, 64)])


@pytest.mark.parametrize("n", [1, 3, 6, 41])
def test_swiglu_ffn_matches_the_specification(lib: ctypes.CDLL, n: int) -> None:
    k, n_ff = 64, 96
    gate, up, down = weight(Q4_1, n_ff, k, 1), weight(Q4_1, n_ff, k, 2), weight(Q8_0, k, n_ff, 3)
    gate_up = qmatmul.QWeight([gate, up], Q4_1, [(n_ff, k), (n_ff, k)])
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    y = qmatmul.ffn_glu(x, gate_up, qmatmul.QWeight([down], Q8_0, [(k, n_ff)]), lib)
    want = qmatmul.ffn_swiglu_ref(x, [(gate, (n_ff, k)), (up, (n_ff, k))], (down, (k, n_ff)), (Q4_1, Q8_0))
    # silu's last bit (expf here, torch's own exp there) can move a hidden value across a rounding
    # boundary of its 8-bit quantization: one quantum of one element, well under 1 % of the output
    torch.testing.assert_close(y, want, rtol=0, atol=0.01 * float(want.abs().max()))


@pytest.mark.parametrize("n", [1, 5])
def test_rms_norm_on_the_way_in(lib: ctypes.CDLL, n: int) -> None:
    k, n_ff = 64, 96
    gen = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, k, generator=gen) * 3, torch.rand(k, generator=gen) + 0.5
    normed = qmatmul.rms_norm_ref(x, w, 1e-5)
    # the sum of squares in another order can move a normed value across a rounding boundary of
    # its 8-bit quantization: one quantum of one element, well under 1 % of the output
    raw = weight(Q4_0, 40, k, 4)
    y = qmatmul.QWeight([raw], Q4_0, [(40, k)])(x, lib, norm=(w, 1e-5))
    want = qmatmul.qmatmul_ref(normed, raw, Q4_0, (40, k))
    torch.testing.assert_close(y, want, rtol=0, atol=0.01 * float(want.abs().max()))
    gate, up, down = weight(Q4_1, n_ff, k, 1), weight(Q4_1, n_ff, k, 2), weight(Q8_0, k, n_ff, 3)
    gate_up = qmatmul.QWeight([gate, up], Q4_1, [(n_ff, k), (n_ff, k)])
    h = qmatmul.ffn_glu(x, gate_up, qmatmul.QWeight([down], Q8_0, [(k, n_ff)]), lib, norm=(w, 1e-5))
    want = qmatmul.ffn_swiglu_ref(
        normed, [(gate, (n_ff, k)), (up, (n_ff, k))], (down, (k, n_ff)), (Q4_1, Q8_0)
    )
    torch.testing.assert_close(h, want, rtol=0, atol=0.01 * float(want.abs().max()))


@pytest.mark.parametrize("n", [1, 3, 41])
def test_gelu_ffn_is_the_op_by_op_geglu(lib: ctypes.CDLL, n: int) -> None:
    """With the GELU table the feed-forward is Gemma's op-by-op geglu, bit for bit: the same
    matmuls, and the lookup of the gate's half is gelu_ggml's value (±10 and past included)."""
    from kvtool.models.layers import gelu_ggml, gelu_table

    k, n_ff = 64, 96
    gate, up, down = weight(Q5_0, n_ff, k, 1), weight(Q5_0, n_ff, k, 2), weight(Q8_0, k, n_ff, 3)
    gate_up = qmatmul.QWeight([gate, up], Q5_0, [(n_ff, k), (n_ff, k)])
    dw = qmatmul.QWeight([down], Q8_0, [(k, n_ff)])
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 8  # gates past ±10 too
    y = qmatmul.ffn_glu(x, gate_up, dw, lib, gelu=gelu_table())
    g, u = gate_up(x, lib).split([n_ff, n_ff], dim=-1)
    assert bool((g.abs() >= 10).any())
    assert torch.equal(y, dw(gelu_ggml(g) * u, lib))


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K])
@pytest.mark.parametrize("n", [1, 9, 33])
def test_a_nan_in_the_activations_reaches_its_row(lib: ctypes.CDLL, qtype: int, n: int) -> None:
    """ggml's activation quantization (q8_act.c: Q8_0, Q8_1, Q8_K) skips a NaN (its max ignores
    it, and it rounds to some int8): the product would be finite and wrong. Its block's scale is
    NaN here, so the row's results are, and the other rows keep their bits, in the row kernels
    and (33 rows and more, where the build has them) the panels."""
    k = 512
    w = qmatmul.QWeight([weight(qtype, 24, k, 5)], qtype, [(24, k)])
    x = torch.randn(n, k)
    clean = w(x, lib)
    x[n - 1, 37] = float("nan")
    y = w(x, lib)
    assert y[n - 1].isnan().all()
    assert torch.equal(y[: n - 1], clean[: n - 1])
