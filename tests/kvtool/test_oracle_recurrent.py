"""Replays llama.cpp's tiny-model scenarios on the pure recurrent architectures (tests/data/tiny,
copied from the oracle): every logits row within 1e-3 relative, and seq_pos_min/max after every
step equal to llama.cpp's. A recurrent memory has no KV streams, so both KV modes must give
llama.cpp's results (which are bitwise equal across modes for these archs)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import kvtool
from tests.kvtool.test_oracle_tiny import DATA, SCENARIOS, replay

ARCHS = ["mamba", "mamba2"]


@functools.cache
def model(arch: str) -> kvtool.Model:
    return kvtool.Model(DATA / "models" / f"tiny-{arch}.gguf")


@pytest.mark.parametrize("unified", [1, 0])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_recurrent_scenario(arch: str, scenario: str, unified: int) -> None:
    z = np.load(DATA / arch / f"{scenario}_kvu{unified}.npz")
    got = replay(model(arch), z, bool(unified))
    ref = z["logits"]
    assert got.shape == ref.shape
    rel = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
    assert rel <= 1e-3
