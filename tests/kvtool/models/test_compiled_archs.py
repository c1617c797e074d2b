"""The compiled decoder call (kernels/decoder_cpu.c) for the llama family's newer members and
gemma2, on tiny quantized models (tests/helpers/tiny_archs.py). For qwen2's Q/K/V biases, phi3's
fused weights and LongRoPE factors, granite's scales, qwen3's per-head Q/K norms and olmo2's norms
over the whole projection and after each block (with sliding layers) the call chains the kernels
the op-by-op forward calls, in its order (its norms too: Backend.rms_norm_ggml), so the logits are
the same bits; gemma2's too (soft-capped scores, Q scaled after the RoPE in both paths)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvtool import Model
from kvtool.kernels import qmatmul
from tests.helpers.decoder_script import count_runs, decode_script, expected_runs
from tests.helpers.quantized import quantizing
from tests.helpers.tiny_archs import VARIANTS, TinyArch, write_tiny_arch

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the kernel is not built")

GRANITE = TinyArch("granite", keys=(("embedding_scale", 6.0), ("residual_scale", 0.22), ("logit_scale", 8.0)))
CASES = {
    "qwen2": VARIANTS["qwen2"],
    "phi3": VARIANTS["phi3"],
    "granite": GRANITE,
    "qwen3": TinyArch("qwen3", head_dim=32, rope_base=1e6),
    "olmo2": VARIANTS["olmo2"],
    "gemma2": VARIANTS["gemma2"],
}


def _qtype(name: str) -> T:
    return T.Q8_0 if name in ("token_embd.weight", "output.weight") else T.Q4_1


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("compiled")
    with quantizing(_qtype):
        return {a: write_tiny_arch(d / f"{a}.gguf", replace(cfg, seed=11)) for a, cfg in CASES.items()}


@pytest.mark.parametrize("kv_unified", [False, True])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_compiled_layers_match_the_op_by_op_forward(
    paths: dict[str, Path], arch: str, kv_unified: bool
) -> None:
    model = Model(paths[arch])
    dec = model.impl.decoder
    assert dec is not None, f"{arch} has no compiled call"
    ran = count_runs(dec)
    compiled = decode_script(model, kv_unified, "f16", steps=8)  # past olmo2's and gemma2's windows
    model.impl.decoder = None
    op_by_op = decode_script(model, kv_unified, "f16", steps=8)
    assert ran == expected_runs(model.hparams.n_layer, steps=8)
    for a, b in zip(compiled, op_by_op, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same models with heads of 64, which every block type tiles (llama.cpp's Hadamard
    rotation on)."""
    d = tmp_path_factory.mktemp("compiled_kv")
    with quantizing(_qtype):
        return {
            a: write_tiny_arch(d / f"{a}.gguf", replace(cfg, seed=12, head_dim=64))
            for a, cfg in CASES.items()
        }


@pytest.mark.parametrize(("type_k", "type_v"), [("q8_0", "q8_0"), ("q4_1", "iq4_nl"), ("q5_0", "q5_1")])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_every_new_architecture_over_quantized_caches(
    wide_heads: dict[str, Path], arch: str, type_k: str, type_v: str
) -> None:
    """Each architecture with quantized K/V (gemma2: soft-capped scores and sliding layers over
    blocks): the compiled call reads the blocks as the op-by-op forward does, and both stay near
    the f32 cache's logits: within 5 % of the largest logit for q8_0, 25 % for the 4/5-bit types
    on these random models (measured up to 18 %), where a block read wrong gives unrelated logits."""
    bound = 0.05 if type_k == type_v == "q8_0" else 0.25
    model = Model(wide_heads[arch])
    compiled = decode_script(model, False, type_k, steps=8, type_v=type_v)
    exact = decode_script(model, False, "f32", steps=8)
    model.impl.decoder = None
    op_by_op = decode_script(model, False, type_k, steps=8, type_v=type_v)
    for a, b, f in zip(compiled, op_by_op, exact, strict=True):
        assert torch.equal(a, b)
        assert float((b - f).abs().max()) <= bound * float(f.abs().max())
