"""benchmarks/random_model.py's random weights: every type it writes decodes to finite values of
about a unit-variance input's spread (1/sqrt(k) per weight), so a model of a real one's shapes
keeps its activations finite while it is timed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf.quants import dequantize

from benchmarks.random_model import FILE_TYPES, T, matrix


@pytest.mark.parametrize("qtype", sorted(FILE_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_random_weights_decode_to_the_spread_of_a_real_matrix(qtype: T) -> None:
    k = 512
    raw = matrix(qtype, 8, k, np.random.default_rng(0))
    w = dequantize(raw, qtype)
    assert w.shape == (8, k)
    assert np.isfinite(w).all()
    rms = float(np.sqrt((w.astype(np.float64) ** 2).mean()))
    assert 0.2 / math.sqrt(k) < rms < 5 / math.sqrt(k)
