"""Fixtures for the state tests: tiny models of each memory kind, contexts, cache snapshots."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvtool
from kvtool.memory.kv_cache import KVCache

TINY = Path(__file__).parents[2] / "data" / "tiny" / "models"


@pytest.fixture(scope="session")
def tiny_gemma3() -> kvtool.Model:
    """Sliding-window layers: its context memory is a SWAKVCache (base + window cache)."""
    return kvtool.Model(TINY / "tiny-gemma3.gguf")


@pytest.fixture(params=["llama", "gemma3"])
def model(
    request: pytest.FixtureRequest, tiny_llama: kvtool.Model, tiny_gemma3: kvtool.Model
) -> kvtool.Model:
    """Every memory kind that exists: KVCache (llama) and SWAKVCache (gemma3)."""
    return tiny_llama if request.param == "llama" else tiny_gemma3


def make_ctx(
    m: kvtool.Model, unified: bool, n_ctx: int = 512, n_seq_max: int = 4, swa_full: bool = True
) -> kvtool.Context:
    # f32 caches: a state restored into another layout sums its attention in another order, and
    # Gemma's half-rounded GELU can turn that last-bit difference into 2e-4 of a logit (f16
    # caches did, in test_context_with_shared_cells_loads_into_either_mode); these tests are
    # about layouts, and the cache types have their own (tests/kvtool/state/test_state_kv_types.py)
    params = kvtool.ContextParams(
        n_ctx=n_ctx,
        n_batch=256,
        n_ubatch=256,
        n_seq_max=n_seq_max,
        kv_unified=unified,
        swa_full=swa_full,
        type_k="f32",
        type_v="f32",
    )
    return kvtool.Context(m, params)


@pytest.fixture
def ctx_of() -> Callable[..., kvtool.Context]:
    return make_ctx


def leaves(memory: Any) -> list[KVCache]:
    return [memory] if isinstance(memory, KVCache) else [c for p in memory.parts.values() for c in leaves(p)]


def snapshot(ctx: kvtool.Context) -> list[Any]:
    """Everything a load could change: cell bookkeeping, K/V tensors, logits."""
    out: list[Any] = [ctx.logits().clone()]
    for cache in leaves(ctx.memory):
        for c in cache.cells:
            out += [c.pos.copy(), c.seq.copy(), c.shift.copy(), c.head, c.has_shift]
        out += [t.clone() for t in (*cache.k.values(), *cache.v.values())]
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


@pytest.fixture
def snap() -> Callable[[kvtool.Context], list[Any]]:
    return snapshot


@pytest.fixture
def unchanged() -> Callable[[list[Any], list[Any]], bool]:
    return same


def prompt(m: kvtool.Model, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, m.n_vocab, size=n).tolist()


@pytest.fixture
def tokens() -> Callable[..., list[int]]:
    return prompt
