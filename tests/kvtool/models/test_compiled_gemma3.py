"""Gemma 3 through the compiled decoder call (kernels/decoder_cpu.c): a tiny quantized gemma3
(Q/K/V of one type in some layers, of several in others; sliding and global layers) decodes
small ubatches in one call, and its logits are the op-by-op forward's bits (the same norms, and
Q scaled after the RoPE in both, as llama.cpp does), in every cache layout and K/V type."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvtool import Model
from kvtool.kernels import qmatmul
from tests.helpers import tiny_gemma3
from tests.helpers.decoder_script import count_runs, decode_script, expected_runs
from tests.helpers.quantized import quantizing
from tests.helpers.tiny_gemma3 import TinyGemma3

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the kernel is not built")


def _qtype(name: str) -> T:
    """Layer 0: Q5_0 Q/K with a Q8_0 V (three compiled weights); other layers Q4_1 throughout."""
    if name in ("token_embd.weight", "blk.0.attn_v.weight"):
        return T.Q8_0
    return T.Q5_0 if name.startswith("blk.0.") else T.Q4_1


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = TinyGemma3(n_embd=64, head_dim=32, n_ff=96, n_swa=6, swa_pattern=2)
    with quantizing(_qtype):
        return tiny_gemma3.write_tiny_gemma3(Path(tmp_path_factory.mktemp("g")) / "tiny-gemma3-q.gguf", cfg)


def test_the_model_has_a_compiled_call_with_both_kinds_of_layer(model_path: Path) -> None:
    dec = Model(model_path).impl.decoder
    assert dec is not None
    assert dec.n_view == 2 and dec.view == [1, 0, 1, 0]  # sliding (view 1), global, ... (pattern 2)
    assert dec._arr[0].wk is not None and dec._arr[1].wk is None  # layer 0: Q, K, V apart


@pytest.mark.parametrize("kv_unified", [False, True])
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_compiled_gemma3_layers_match_the_op_by_op_forward(
    model_path: Path, kv_unified: bool, cache_type: str
) -> None:
    model = Model(model_path)
    dec = model.impl.decoder
    assert dec is not None
    ran = count_runs(dec)
    compiled = decode_script(model, kv_unified, cache_type, steps=8)  # past the sliding window
    model.impl.decoder = None
    op_by_op = decode_script(model, kv_unified, cache_type, steps=8)
    assert ran == expected_runs(model.hparams.n_layer, steps=8)
    for a, b in zip(compiled, op_by_op, strict=True):
        assert torch.equal(a, b)


# Over a quantized K the query is quantized too (q8_0/q8_1, as ggml's flash attention does), so
# where Q is scaled, before that or on the scores, changes the logits by whole quantization steps
@pytest.mark.parametrize("cache_type", ["iq4_nl", "q4_0", "q4_1", "q8_0"])
def test_compiled_gemma3_layers_over_quantized_caches(model_path: Path, cache_type: str) -> None:
    model = Model(model_path)
    dec = model.impl.decoder
    assert dec is not None
    ran = count_runs(dec)
    compiled = decode_script(model, False, cache_type, steps=8)
    model.impl.decoder = None
    op_by_op = decode_script(model, False, cache_type, steps=8)
    assert ran == expected_runs(model.hparams.n_layer, steps=8)
    for a, b in zip(compiled, op_by_op, strict=True):
        assert torch.equal(a, b)
