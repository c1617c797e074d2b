"""A tiny llama quantized by llama.cpp to Q2_K, Q3_K_S, IQ4_NL and IQ4_XS (tests/data/quant, from the
oracle's section 9): kvtool replays llama.cpp's `single` scenario on each file and must give its
logits. Quantized weights: llama.cpp quantizes each activation row to the format's dot-product
type, which moves its logits 1.6-2.1 % from those of the same weights dequantized; kvtool does
the same and lands within 1e-5 (it measured at most 3.4e-7: float sums in another order).
`weights="f32"` (the dequantized weights) against llama.cpp's run on an F32 model of them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvtool
from kvtool.backend.linear import QUANT_MAX_ROWS, QuantLinear
from tests.kvtool.test_oracle_tiny import rel_err, replay

DATA = Path(__file__).parent.parent.parent / "data" / "quant"
TYPES = ["Q2_K", "Q3_K_S", "IQ4_NL", "IQ4_XS"]


@pytest.mark.parametrize("qtype", TYPES)
def test_quantized_weights_give_llama_cpps_logits(qtype: str) -> None:
    z = np.load(DATA / f"{qtype}_single.npz")
    model = kvtool.Model(DATA / "models" / f"tiny-q-{qtype}.gguf")
    got = replay(model, z, unified=True)
    gap = rel_err(np.load(DATA / f"{qtype}_single_dequant.npz")["logits"], z["logits"])
    assert gap > 0.01  # what activation quantization moves: a kernel that left it out would be off this much
    assert rel_err(got, z["logits"]) <= 1e-5


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantized_weights_give_llama_cpps_f32_logits(qtype: str) -> None:
    z = np.load(DATA / f"{qtype}_single_dequant.npz")
    model = kvtool.Model(DATA / "models" / f"tiny-q-{qtype}.gguf", weights="f32")
    assert rel_err(replay(model, z, unified=True), z["logits"]) <= 1e-3


@pytest.mark.parametrize("qtype", TYPES)
def test_prompts_stay_in_the_compiled_kernel(qtype: str) -> None:
    """More rows than QUANT_MAX_ROWS (a prompt) stay in the compiled kernel for the low-bit
    formats: their float32 copy would be 7-12 times their bytes."""
    model = kvtool.Model(DATA / "models" / f"tiny-q-{qtype}.gguf")
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_seq_max=1))
    ctx.decode(kvtool.Batch.from_tokens(list(range(3, 3 + 3 * QUANT_MAX_ROWS)), logits="all"))
    linears = [lin for layer in model.impl.layers for lin in (layer.wo, layer.ffn_down, layer.wqkv.fused)]
    assert linears and all(isinstance(lin, QuantLinear) and lin.native is not None for lin in linears)
    assert all(lin._dense is None for lin in linears if isinstance(lin, QuantLinear))
