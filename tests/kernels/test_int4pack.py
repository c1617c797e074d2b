"""kernels.int4pack: the int4 decomposition of GGUF formats is bit-exact against
gguf.quants.dequantize, and torch's packed kernel computes what the float32 reference says."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize

from kvtool.common import registry
from kvtool.gguf_file import GGUFFile
from kvtool.kernels.int4pack import (
    _pack_nibbles,
    dequantize_groups_ref,
    int4_groups,
    int4_linear,
    int4_linear_ref,
    pack,
    packable,
)

T = GGMLQuantizationType
MODELS = registry.cache_dir()
SHAPE = (48, 512)  # N a multiple of 16, K of 256 (a K-quant super-block)
QUANTIZED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]  # gguf can quantize these itself
K_QUANTS = [T.Q4_K, T.Q5_K]


def quantized(qtype: T, seed: int) -> np.ndarray:
    """Real quantizer output (scales and mins as a quantizer sets them) for random weights."""
    w = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32) * 0.05
    return quantize(w, qtype)


def k_quant_bytes(qtype: T, seed: int) -> np.ndarray:
    """Random K-quant blocks whose d and dmin have a quantizer's magnitudes (~1e-3)."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = SHAPE[0] * SHAPE[1] // 256
    b = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for at in (0, 2):
        half = (np.abs(rng.standard_normal(n_blocks)) * 1e-3).astype(np.float16)
        b[:, at : at + 2] = half.view(np.uint8).reshape(n_blocks, 2)
    return b.reshape(SHAPE[0], -1)


def raw_for(qtype: T, seed: int = 0) -> np.ndarray:
    return k_quant_bytes(qtype, seed) if qtype in K_QUANTS else quantized(qtype, seed)


def assert_bits_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    """Same float32 values (a zero may differ in sign: (q - 8) * d + 0 is +0 where d * (q - 8) is -0)."""
    ours_np, ref = ours.numpy(), ref.astype(np.float32)
    np.testing.assert_array_equal(ours_np, ref)
    nonzero = ref != 0
    np.testing.assert_array_equal(ours_np.view(np.int32)[nonzero], ref.view(np.int32)[nonzero])


# Exact: one plane (z = c + 8a, exact for a quantizer's d and m) or offsets that are multiples
# of d (Q5_0, Q8_0). Q5_1/Q5_K put c + 24a in the zero, which may round once more.
EXACT = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_0, T.Q8_0]


@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS, ids=lambda t: t.name)
def test_groups_reproduce_gguf(qtype: T) -> None:
    raw = raw_for(qtype)
    g = int4_groups(torch.from_numpy(raw), int(qtype), SHAPE)
    assert g.n_planes == (1 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 2)
    for p, _, _ in g.planes():
        assert int(p.max()) <= 15
    ours, ref = dequantize_groups_ref(g), ref_dequantize(raw, qtype)
    if qtype in EXACT:
        assert_bits_equal(ours, ref)
    else:  # within one float32 rounding of the weight
        np.testing.assert_allclose(ours.numpy(), ref, rtol=2**-22, atol=2**-22 * float(np.abs(ref).max()))


@pytest.mark.parametrize("qtype", QUANTIZED + K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_packed_kernel_matches_reference(qtype: T, rows: int) -> None:
    g = int4_groups(torch.from_numpy(raw_for(qtype, seed=1)), int(qtype), SHAPE)
    x = torch.randn(rows, SHAPE[1], generator=torch.Generator().manual_seed(rows))
    ref = int4_linear_ref(x, g)
    got = int4_linear(x, pack(g))
    assert got.dtype == torch.float32 and got.shape == (rows, SHAPE[0])
    # the kernel accumulates in float32 and rounds each plane's output to bfloat16 (2^-9 relative)
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-7 * float(ref.abs().max()))
    # and the bfloat16 rounding of scales and activations stays small against the exact weights
    exact = x @ dequantize_groups_ref(g).t()
    assert float((got - exact).abs().max()) <= 0.02 * float(exact.abs().max())


def test_packable_needs_a_mapped_type_and_kernel_shapes() -> None:
    assert packable(int(T.Q4_1), (576, 1536))
    assert not packable(int(T.Q6_K), (576, 1536))  # 16-element sub-blocks: no exact mapping
    assert not packable(int(T.F32), (576, 1536))
    assert not packable(int(T.Q4_0), (40, 64))  # N not a multiple of 16
    assert not packable(int(T.Q4_0), (576,))
    with pytest.raises(ValueError, match="int4pack"):
        int4_groups(torch.zeros(36, dtype=torch.uint8), int(T.Q6_K), (16, 16))


REAL = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": [T.Q8_0, T.Q4_1],
    "gemma-3-270m-q4_k_m.gguf": [T.Q5_0, T.Q4_K, T.Q8_0],
}


@pytest.mark.real
@pytest.mark.parametrize(
    ("file", "qtype"), [(f, t) for f, ts in REAL.items() for t in ts], ids=lambda x: getattr(x, "name", x)
)
def test_real_tensor_groups_match_gguf(file: str, qtype: T) -> None:
    if not (MODELS / file).exists():
        registry.fetch_model(
            next(n for n, k in registry.KNOWN_MODELS.items() if k.filename == file), progress=False
        )
    f = GGUFFile(MODELS / file)
    infos = [f.tensor_info(n) for n in f.tensor_names() if f.tensor_info(n).qtype == qtype]
    info = min(infos, key=lambda t: t.n_bytes)  # the smallest keeps the test quick
    assert packable(info.qtype, info.shape)
    raw = f.tensor_bytes(info.name)
    g = int4_groups(raw, info.qtype, info.shape)  # type: ignore[arg-type]
    assert_bits_equal(dequantize_groups_ref(g), ref_dequantize(raw.numpy().reshape(info.shape[0], -1), qtype))


@pytest.mark.parametrize("shape", [(32, 64), (96, 576), (64, 1536), (48, 256)])
def test_direct_packing_equals_torchs_converter(shape: tuple[int, int]) -> None:
    q = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    want = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    assert torch.equal(_pack_nibbles(q), want)
