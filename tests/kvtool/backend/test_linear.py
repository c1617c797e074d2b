"""kvtool.backend.linear: packed weights switch by rows, group matmuls split back exactly, and
embeddings dequantize only the rows asked for, all against gguf.quants.dequantize."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize

from kvtool.backend.linear import (
    QUANT_MAX_ROWS,
    DenseLinear,
    Embedding,
    LinearGroup,
    QuantLinear,
    check_weights_mode,
    load_linear,
)
from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile
from kvtool.kernels import qmatmul

T = GGMLQuantizationType
N_IN = 64
WEIGHTS = {  # name: (type, n_out)
    "q": (T.Q4_1, 64),
    "k": (T.Q4_0, 32),
    "v": (T.Q4_K, 32),
    "gate": (T.Q8_0, 48),
    "up": (T.Q5_1, 48),
    "emb": (T.Q8_0, 100),
    "odd": (T.Q4_0, 40),  # n_out not a multiple of 16: stays dense
    "f32": (T.F32, 32),
}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    rng = np.random.default_rng(0)
    path = Path(tmp_path_factory.mktemp("lin")) / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, n_out) in WEIGHTS.items():
        x = (rng.standard_normal((n_out, N_IN if qtype != T.Q4_K else 256)) * 0.1).astype(np.float32)
        if qtype == T.F32:
            w.add_tensor(name, x)
        elif qtype == T.Q4_K:  # gguf cannot quantize K-quants: random blocks with small scales
            b = rng.integers(0, 256, size=(n_out, 144), dtype=np.uint8)
            b[:, 0:4] = np.full((n_out, 2), 1e-3, dtype=np.float16).view(np.uint8)
            w.add_tensor(name, b, raw_dtype=qtype)
        else:
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def exact(f: GGUFFile, name: str) -> torch.Tensor:
    info = f.tensor_info(name)
    raw = f.tensor_bytes(name).numpy().reshape(info.shape[0], -1)
    return torch.from_numpy(ref_dequantize(raw, T(info.qtype)).astype(np.float32)).reshape(info.shape)


def test_few_rows_take_the_packed_path_many_rows_the_panel_kernel_or_the_exact_dense_one(
    gguf_file: GGUFFile,
) -> None:
    for name in ("q", "gate"):  # Q4_1: the panel kernel where it is built; Q8_0: never
        lin = load_linear(gguf_file, name, "auto")
        assert isinstance(lin, QuantLinear)
        w, info = exact(gguf_file, name), gguf_file.tensor_info(name)
        few = torch.randn(QUANT_MAX_ROWS, w.shape[1])
        torch.testing.assert_close(lin(few), F.linear(few, w), rtol=0.02, atol=0.02)
        many = torch.randn(QUANT_MAX_ROWS + 1, w.shape[1])
        if lin.native is not None and lin.native.panels:
            assert lin.computes_natively(QUANT_MAX_ROWS + 1) and lin._dense is None  # never dequantized
            ref = qmatmul.qmatmul_ref(many, gguf_file.tensor_bytes(name), info.qtype, info.shape)
            torch.testing.assert_close(lin(many), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        else:
            assert torch.equal(lin(many), F.linear(many, w))  # dense float32, bit for bit


def test_unmappable_weights_stay_dense(gguf_file: GGUFFile) -> None:
    names = ("f32",) if qmatmul.available() else ("odd", "f32")  # int4pack needs n_out % 16 == 0
    for name in names:
        lin = load_linear(gguf_file, name, "auto")
        assert isinstance(lin, DenseLinear) and torch.equal(lin.weight, exact(gguf_file, name))
    assert isinstance(load_linear(gguf_file, "q", "f32"), DenseLinear)


@pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the compiled kernel is not built")
def test_the_compiled_kernel_takes_every_format_it_has(gguf_file: GGUFFile) -> None:
    for name in ("q", "k", "v", "gate", "odd", "emb"):  # Q4_1, Q4_0, Q4_K, Q8_0, n_out 40, Q8_0
        lin = load_linear(gguf_file, name, "auto")
        assert isinstance(lin, QuantLinear) and lin.native is not None and lin.packed is None
        w, info = exact(gguf_file, name), gguf_file.tensor_info(name)
        x = torch.randn(3, w.shape[1])
        y, want = lin(x), F.linear(x, w)
        ref = qmatmul.qmatmul_ref(x, gguf_file.tensor_bytes(name), info.qtype, info.shape)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert float((y - want).abs().max()) < 0.02 * float(want.abs().max())  # 8-bit activations
    up = load_linear(gguf_file, "up", "auto")  # Q5_1: no compiled kernel, int4pack
    assert isinstance(up, QuantLinear) and up.native is None and up.packed is not None


@pytest.mark.parametrize("names", [["q", "k"], ["gate", "up"]])
@pytest.mark.parametrize("rows", [1, QUANT_MAX_ROWS + 3])
def test_a_group_splits_back_into_its_weights(gguf_file: GGUFFile, names: list[str], rows: int) -> None:
    group = LinearGroup(gguf_file, names, "auto", [None, torch.arange(WEIGHTS[names[1]][1]).float()])
    infos = [gguf_file.tensor_info(n) for n in names]
    if qmatmul.available() and all(qmatmul.supported(i.qtype, i.shape) for i in infos):
        # two types, each in the compiled kernel: a compiled call each, not one int4pack stack
        assert group.fused is None
        assert all(isinstance(p, QuantLinear) and p.native is not None for p in group.parts)
    else:
        assert group.fused is not None  # same plane count: one stacked int4pack matmul
    x = torch.randn(rows, N_IN)
    outs = group(x)
    for out, name, bias in zip(outs, names, (None, torch.arange(WEIGHTS[names[1]][1]).float()), strict=True):
        want = F.linear(x, exact(gguf_file, name), bias)
        if rows > QUANT_MAX_ROWS and group.fused is not None:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # one dense GEMM over the stack
        else:
            torch.testing.assert_close(out, want, rtol=0.02, atol=0.02)


def test_a_group_of_different_plane_counts_or_f32_runs_separately(gguf_file: GGUFFile) -> None:
    assert LinearGroup(gguf_file, ["q", "up"], "auto", [None, None]).fused is None  # 1 and 2 planes
    g = LinearGroup(gguf_file, ["q", "k"], "f32", [None, None])
    x = torch.randn(3, N_IN)
    assert g.fused is None
    for out, name in zip(g(x), ["q", "k"], strict=True):
        assert torch.equal(out, F.linear(x, exact(gguf_file, name)))


@pytest.mark.parametrize("weights", ["auto", "f32"])
def test_embedding_rows_are_exact(gguf_file: GGUFFile, weights: str) -> None:
    emb = Embedding(gguf_file, "emb", weights)
    assert (emb.dense is None) == (weights == "auto")
    ids = torch.tensor([5, 0, 99, 5])
    assert torch.equal(emb(ids), exact(gguf_file, "emb")[ids])


def test_unknown_weights_mode_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="weights mode"):
        check_weights_mode("int3")
