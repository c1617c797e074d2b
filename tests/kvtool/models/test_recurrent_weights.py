"""The recurrent and hybrid architectures follow `--weights` as the attention models do: on
quantized copies of the tiny models (the tensors llama-quantize quantizes, in Q8_0, Q4_0, or
Q2_K where a row is a multiple of 256), "auto" keeps the block projections, the embedding and
the output quantized and multiplies them in the compiled kernel, against "f32" on the same file;
"bf16" keeps them dense in bfloat16."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvtool import Model
from kvtool.backend.linear import QUANT_MAX_ROWS, DenseLinear, Embedding, LinearGroup, QuantLinear
from kvtool.kernels import qmatmul
from kvtool.kernels.dequant import F32
from tests.helpers.quantized import logits, quantized_copy

MODELS = Path(__file__).parents[2] / "data" / "tiny" / "models"
ARCHS = ("mamba", "mamba2", "rwkv6", "rwkv7", "granitehybrid", "lfm2")
# per copy: the types to try in order, the first whose block divides a row (Q2_K: 256)
TYPES = {"q8_0": (T.Q8_0,), "q4_0": (T.Q4_0,), "q2_k": (T.Q2_K, T.Q8_0)}

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the kernel is not built")


def _qtype_of(types: tuple[T, ...]) -> Callable[[str, int], T | None]:
    def pick(name: str, k: int) -> T | None:
        for t in types:
            if k % (256 if t == T.Q2_K else 32) == 0:
                return t
        return None

    return pick


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    made: dict[tuple[str, str], Path] = {}
    root = tmp_path_factory.mktemp("recurrent-q")

    def get(arch: str, kind: str) -> Path:
        if (arch, kind) not in made:
            src = MODELS / f"tiny-{arch}.gguf"
            made[arch, kind] = quantized_copy(src, root / f"tiny-{arch}-{kind}.gguf", _qtype_of(TYPES[kind]))
        return made[arch, kind]

    return get


def linears(obj: Any) -> Iterator[tuple[str, Any]]:
    """Every Linear, LinearGroup and Embedding a model holds, with where it sits."""
    seen: set[int] = set()

    def walk(o: Any, where: str) -> Iterator[tuple[str, Any]]:
        if id(o) in seen or isinstance(o, (torch.Tensor, int, float, str, bool)) or o is None:
            return
        seen.add(id(o))
        if isinstance(o, (QuantLinear, DenseLinear, LinearGroup, Embedding)):
            yield where, o
        elif isinstance(o, (list, tuple)):
            for i, x in enumerate(o):
                yield from walk(x, f"{where}[{i}]")
        elif hasattr(o, "__dict__"):
            for k, v in vars(o).items():
                yield from walk(v, f"{where}.{k}")

    yield from walk(obj, "model")


TOKENS = ([1, 5, 9, 3, 7, 11, 4, 8, 2, 6, 13, 21] * 6)[: QUANT_MAX_ROWS + 8]


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_keeps_the_projections_quantized(
    copies: Callable[[str, str], Path], arch: str, kind: str
) -> None:
    path = copies(arch, kind)
    auto, exact = Model(path), Model(path, weights="f32")
    held = [lin for _, lin in linears(auto.impl)]
    held += [g.fused for g in held if isinstance(g, LinearGroup) and g.fused is not None]
    in_blocks = {
        n for lin in held if isinstance(lin, QuantLinear) and lin.native is not None for n in lin._names
    }
    f = auto.file
    quantized = {n for n in f.tensor_names() if len(f.tensor_shape(n)) == 2 and f.tensor_info(n).qtype != F32}
    # every quantized matrix is multiplied in its blocks; the embedding dequantizes rows it looks up
    assert quantized - {"token_embd.weight"} <= in_blocks, sorted(quantized - in_blocks)
    assert all(e.dense is None for e in held if isinstance(e, Embedding))
    if kind != "q2_k":  # each projection against gguf: f32 weights, rows quantized to Q8_0
        exact_of = {w: lin for w, lin in linears(exact.impl)}
        x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0))
        for w, lin in linears(auto.impl):
            if isinstance(lin, QuantLinear) and isinstance(exact_of[w], DenseLinear):
                k = exact_of[w].weight.shape[1]
                want = _q8_0_activations(exact_of[w], x[:, :k])
                err = float((lin(x[:, :k]) - want).abs().max() / want.abs().max())
                # the kernel scales each activation block by max|x| / 127 in float32, gguf by that
                # scale rounded to a half: 2^-11 relative, below 1e-3
                assert err < 1e-3, (w, err)
    tokens = TOKENS
    want = logits(exact, tokens, len(tokens))
    few = logits(auto, tokens, 1)  # one row per ubatch: the compiled kernel
    err = float((few - want).abs().max() / want.abs().max())
    # the 8-bit activations (llama.cpp's CPU backend quantizes them alike) move these random tiny
    # models' logits by 1-4 % of their range through the scans, never to zero (the kernel ran)
    assert 0 < err < 0.06, err
    assert float((few.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8  # near ties of random logits
    many = logits(auto, tokens, len(tokens))  # one prompt ubatch: the panel kernel or float32 GEMMs
    err = float((many - want).abs().max() / want.abs().max())
    assert err < 0.06, err


def _q8_0_activations(lin: DenseLinear, x: torch.Tensor) -> torch.Tensor:
    """lin(x) with x's rows quantized to Q8_0 by gguf first (llama.cpp's CPU backend's
    vec_dot_type for Q8_0 and Q4_0 weights)."""
    q = quantize(x.numpy(), T.Q8_0)
    return F.linear(torch.from_numpy(dequantize(q, T.Q8_0)), lin.weight, lin.bias)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_keeps_the_projections_in_bf16(copies: Callable[[str, str], Path], arch: str) -> None:
    path = copies(arch, "q8_0")
    model, exact = Model(path, weights="bf16"), Model(path, weights="f32")
    held = [lin for _, lin in linears(model.impl)]
    dense = [d for lin in held for d in (lin.parts if isinstance(lin, LinearGroup) else [lin])]
    dense = [d for d in dense if isinstance(d, DenseLinear)]
    f = model.file
    quantized = [n for n in f.tensor_names() if len(f.tensor_shape(n)) == 2 and f.tensor_info(n).qtype != F32]
    # every matrix quantized in the file is a bf16 linear (the embedding is looked up, not multiplied)
    assert len(dense) >= len(quantized) - 1 and all(d.weight.dtype == torch.bfloat16 for d in dense)
    got, want = logits(model, TOKENS[:12], 4), logits(exact, TOKENS[:12], 4)
    err = float((got - want).abs().max() / want.abs().max())
    assert 0 < err < 0.05, err  # bf16 weights and inputs: 8 bits of mantissa
