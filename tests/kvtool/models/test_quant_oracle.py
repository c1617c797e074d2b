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
