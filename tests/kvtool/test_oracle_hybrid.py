"""Replays llama.cpp's tiny-model scenarios on the hybrid architectures (granitehybrid: Mamba-2 +
attention; lfm2: short convolution + attention), from the pure-F32 (`_faoff`) references copied
into tests/data/tiny: every logits row within 1e-3 relative, seq_pos_min/max after every step
equal to llama.cpp's (the replay checks them), in both KV modes. rm_tail checks that the partial
seq_rm is refused (the recurrent part cannot cut back) and the decode after it fails."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import kvtool
from tests.kvtool.test_oracle_tiny import DATA, SCENARIOS, replay

ARCHS = ["granitehybrid", "lfm2"]


@functools.cache
def model(arch: str) -> kvtool.Model:
    return kvtool.Model(DATA / "models" / f"tiny-{arch}.gguf")


@pytest.mark.parametrize("unified", [1, 0])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_hybrid_scenario(arch: str, scenario: str, unified: int) -> None:
    z = np.load(DATA / arch / f"{scenario}_kvu{unified}_faoff.npz")
    got = replay(model(arch), z, bool(unified))
    ref = z["logits"]
    assert got.shape == ref.shape
    rel = np.abs(got - ref).max() / max(1.0, np.abs(ref).max())
    assert rel <= 1e-3
