"""The low-bit formats' row kernels (kernels/qrows_lowbit.c: Q2_K, Q3_K, IQ4_XS, IQ4_NL), reached
through qmatmul's QWeight, against its torch specification (qmatmul_ref); the specification's
activation quantization against ggml's (Q8_K, and Q8_0 with an fp16 scale), written out from
ggml-quants.c here."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvtool.kernels import qmatmul
from kvtool.kernels.dequant import IQ4_NL, Q2_K, dequantize
from kvtool.kernels.qmatmul import LOWBIT_TYPES as TYPES
from kvtool.kernels.qmatmul import qmatmul_ref, quantize_q8_0_ref, quantize_q8_K_ref
from tests.helpers.lowbit import random_blocks

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the kernel is not built")


def weight(qtype: int, n_out: int, k: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, n_out, k, np.random.default_rng(seed)))  # type: ignore[arg-type]


def activations(n: int, k: int) -> torch.Tensor:
    x = torch.randn(n, k) * torch.logspace(-2, 1, k)  # blocks of very different scales
    x[0, :256] = 0.0  # an all-zero super-block: scale 0
    return x


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 3, 4, 5, 9, 40])
@pytest.mark.parametrize("threads", [1, 3])
def test_matches_the_specification(lib: ctypes.CDLL, qtype: int, n: int, threads: int) -> None:
    k = 768
    shapes = [(40, k), (24, k), (17, k)]  # stacked like Q, K and V
    raws = [weight(qtype, s[0], k, 7 * qtype + i) for i, s in enumerate(shapes)]
    x = activations(n, k)
    lib.kvq_set_threads(threads)
    try:
        y = qmatmul.QWeight(raws, qtype, shapes)(x, lib)
    finally:
        lib.kvq_set_threads(torch.get_num_threads())
    want = torch.cat([qmatmul_ref(x, r, qtype, s) for r, s in zip(raws, shapes, strict=True)], 1)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", TYPES)
def test_a_row_gives_the_same_bits_alone_or_among_others(lib: ctypes.CDLL, qtype: int) -> None:
    k = 512
    w = qmatmul.QWeight([weight(qtype, 33, k, 3)], qtype, [(33, k)])
    x = activations(11, k)
    together = w(x, lib)
    for i in range(x.shape[0]):
        assert torch.equal(w(x[i : i + 1], lib)[0], together[i]), i
    assert torch.equal(w(x[2:9], lib), together[2:9])


@pytest.mark.parametrize("qtype", TYPES)
def test_rms_norm_on_the_way_in(lib: ctypes.CDLL, qtype: int) -> None:
    k = 512
    raw = weight(qtype, 20, k, 5)
    x, nw = torch.randn(3, k), torch.rand(k) + 0.5
    y = qmatmul.QWeight([raw], qtype, [(20, k)])(x, lib, norm=(nw, 1e-5))
    normed = qmatmul.rms_norm_ref(x, nw, 1e-5)
    want = qmatmul_ref(normed, raw, qtype, (20, k))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def _q8_k_ggml(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml-quants.c's quantize_row_q8_K_ref, line by line."""
    qs, ds = [], []
    for xb in x.reshape(-1, 256):
        amax = mx = np.float32(0)
        for v in xb:
            if abs(v) > amax:
                amax, mx = abs(v), v
        if amax == 0:
            qs.append(np.zeros(256)), ds.append(0.0)
            continue
        iscale = np.float32(-127.0) / mx
        q = [min(127, int(np.rint(np.float32(iscale * v)))) for v in xb]  # rint: ties to even
        qs.append(np.array(q)), ds.append(np.float32(1) / iscale)
    return np.array(qs, np.float32), np.array(ds, np.float32)


def test_q8_k_is_ggmls() -> None:
    x = torch.randn(2, 512) * 3
    x[1, 256:] = 0.0
    x[0, 7], x[0, 9] = -50.0, 50.0  # equal magnitudes: the first one sets the sign of the scale
    q, d = quantize_q8_K_ref(x)
    want_q, want_d = _q8_k_ggml(x.numpy())
    assert np.array_equal(q.reshape(-1, 256).numpy(), want_q)
    assert np.array_equal(d.reshape(-1).numpy(), want_d)
    assert d[0, 0, 0] > 0  # -50 / -127: the negative element came first


def test_q8_0_keeps_its_scale_as_a_half() -> None:
    x = torch.randn(3, 64)
    q, d = quantize_q8_0_ref(x)
    amax = x.reshape(3, 2, 32).abs().amax(-1, keepdim=True)
    assert torch.equal(d, (amax / 127).half().float())  # not amax / 127 in float32
    assert torch.equal(q, torch.round(x.reshape(3, 2, 32) * (127 / amax)))
    assert q.abs().max() == 127


@pytest.mark.parametrize("qtype", TYPES)
def test_the_activations_are_quantized_per_format(lib: ctypes.CDLL, qtype: int) -> None:
    """Q2_K, Q3_K and IQ4_XS take Q8_K activations (one scale per 256), IQ4_NL takes Q8_0 (one
    per 32): a large value coarsens its whole super-block under Q8_K, only its own 32 under Q8_0."""
    k = 256
    raw = weight(qtype, 8, k, 1)
    x = torch.randn(1, k)
    x[0, 0] = 1000.0
    y = qmatmul.QWeight([raw], qtype, [(8, k)])(x, lib)
    w = dequantize(raw, qtype, (8, k)).double()
    q8_k, d8_k = quantize_q8_K_ref(x)
    by_q8_k, by_q8_0 = ((q * d).reshape(1, k).double() @ w.T for q, d in ((q8_k, d8_k), quantize_q8_0_ref(x)))
    want, other = (by_q8_0, by_q8_k) if qtype == IQ4_NL else (by_q8_k, by_q8_0)
    err = (y.double() - want).abs().max()
    assert err <= 1e-5 * want.abs().max()
    assert (y.double() - other).abs().max() > 100 * err


def test_bad_widths_are_refused() -> None:
    raw = weight(Q2_K, 4, 256, 0)
    with pytest.raises(ValueError, match="no qmatmul kernel"):
        qmatmul.QWeight([raw], Q2_K, [(8, 128)])  # K-quant rows are 256-element super-blocks


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n", [1, 9, 40])
def test_a_nan_in_the_activations_reaches_its_row(lib: ctypes.CDLL, qtype: int, n: int) -> None:
    """ggml's Q8_K and Q8_0 quantization (q8_act.c) skip a NaN (it would vanish from the
    product): its block's scale is NaN here, so the row's results are, and the other rows keep
    their bits."""
    k = 512
    w = qmatmul.QWeight([weight(qtype, 24, k, 5)], qtype, [(24, k)])
    x = activations(n, k)
    clean = w(x, lib)
    x[n - 1, 300] = float("nan")
    y = w(x, lib)
    assert y[n - 1].isnan().all()
    assert torch.equal(y[: n - 1], clean[: n - 1])
