"""RWKV-6 and RWKV-7 against llama.cpp: every tiny scenario in both KV modes (tests/data/tiny,
copied from the oracle; the plain files, since no attention is involved), logits within 1e-3
relative and seq_pos_min/max after every step, replayed as for the attention models."""

from __future__ import annotations

import numpy as np
import pytest

import kvtool
from tests.kvtool.test_oracle_tiny import DATA, SCENARIOS, replay

ARCHS = ["rwkv6", "rwkv7"]


def load(arch: str) -> kvtool.Model:
    return kvtool.Model(DATA / "models" / f"tiny-{arch}.gguf")


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    assert got.shape == ref.shape
    return float(np.abs(got - ref).max() / max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("unified", [1, 0])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_scenario(arch: str, scenario: str, unified: int) -> None:
    z = np.load(DATA / arch / f"{scenario}_kvu{unified}.npz")
    assert rel_err(replay(load(arch), z, bool(unified)), z["logits"]) <= 1e-3


@pytest.mark.parametrize("n_ubatch", [1, 5, 24])
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_split_into_ubatches(arch: str, n_ubatch: int) -> None:
    """The `single` prompt cut into ubatches of n_ubatch tokens: the states carried from one
    ubatch to the next (token shifts and WKV) give llama.cpp's one-ubatch logits."""
    z = np.load(DATA / arch / "single_kvu1.npz")
    n = int(z["step_offsets"][1])
    ctx = kvtool.Context(
        load(arch), kvtool.ContextParams(n_ctx=256, n_batch=256, n_ubatch=n_ubatch, n_seq_max=1)
    )
    ctx.decode(kvtool.Batch.from_tokens([int(t) for t in z["tokens"][:n]], seq_id=0, pos0=0, logits="all"))
    assert rel_err(ctx.logits().numpy(), z["logits"][:n]) <= 1e-3
