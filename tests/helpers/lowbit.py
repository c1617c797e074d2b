"""Random weights in the formats gguf cannot quantize (Q2_K, Q3_K, IQ4_XS, IQ4_NL): random bits
with scales chosen so that a dequantized row has about the spread of N(0, 1/k) weights."""

from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
# per format: byte offsets of its fp16 scales, and the largest |value| a scale multiplies
_SCALES = {
    T.Q2_K: ([80, 82], 15 * 3),
    T.Q3_K: ([108], 32 * 4),
    T.IQ4_XS: ([0], 32 * 127),
    T.IQ4_NL: ([0], 127),
}
TYPES = list(_SCALES)


def random_blocks(qtype: T, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks [n_out, row bytes] of a random `qtype` weight of numpy shape (n_out, k)."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(n_out * k // block, size), dtype=np.uint8)
    at, top = _SCALES[qtype]
    for a in at:
        d = rng.uniform(0.5, 2.0, size=b.shape[0]) / (top * math.sqrt(k))
        b[:, a : a + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(n_out, -1)
