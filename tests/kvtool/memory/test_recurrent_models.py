"""Rollback and failed-batch undo on the tiny Mamba models: logits after a rollback equal a
fresh decode of the same tokens, and llama.cpp's refusals hold without snapshots."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

import kvtool
from kvtool.memory.spec import MemoryParams

DATA = Path(__file__).parent.parent.parent / "data" / "tiny"
ARCHS = ["mamba", "mamba2"]
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 384, 24)]


@functools.cache
def model(arch: str) -> kvtool.Model:
    return kvtool.Model(DATA / "models" / f"tiny-{arch}.gguf")


def context(arch: str, n_rs_seq: int, n_ubatch: int = 64) -> kvtool.Context:
    params = kvtool.ContextParams(n_ctx=256, n_batch=64, n_ubatch=n_ubatch, n_seq_max=2)
    ctx = kvtool.Context(model(arch), params)
    # ContextParams has no n_rs_seq yet: build the memory with it as the context would
    ctx.memory = (
        model(arch)
        .memory_spec()
        .build(MemoryParams(n_ctx_seq=256, n_seq_max=2, n_ubatch=n_ubatch, n_rs_seq=n_rs_seq))
    )
    return ctx


def decode(ctx: kvtool.Context, tokens: list[int], pos0: int, seq: int = 0) -> np.ndarray:
    b = kvtool.Batch()
    for i, t in enumerate(tokens):
        b.add(t, pos0 + i, [seq], True)
    ctx.decode(b)
    return ctx.logits().numpy().copy()


def close(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_after_generated_tokens_equals_a_fresh_decode(arch: str) -> None:
    ctx = context(arch, n_rs_seq=3)
    decode(ctx, PROMPT[:20], 0)
    for i in range(3):  # pos 20, 21, 22
        decode(ctx, [PROMPT[20 + i]], 20 + i)
    assert ctx.memory.seq_rm(0, 10, -1) is False  # 13 back: beyond the window
    assert ctx.memory.seq_can_resume(0, 21) and not ctx.memory.seq_can_resume(0, 19)
    assert ctx.memory.seq_rm(0, 21, -1) is True
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (20, 20)
    got = decode(ctx, [5, 6], 21)
    fresh = context(arch, n_rs_seq=0)
    want = decode(fresh, [*PROMPT[:21], 5, 6], 0)[-2:]
    close(got, want)


@pytest.mark.parametrize("n_ubatch", [64, 7])
@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_inside_a_prompt(arch: str, n_ubatch: int) -> None:
    # the snapshots come from inside one ubatch (64) or straddle ubatches (7)
    ctx = context(arch, n_rs_seq=4, n_ubatch=n_ubatch)
    want = decode(ctx, PROMPT, 0)
    assert ctx.memory.seq_rm(0, 20, -1) is True
    close(decode(ctx, PROMPT[20:], 20), want[20:])


@pytest.mark.parametrize("arch", ARCHS)
def test_without_snapshots_partial_removal_is_refused(arch: str) -> None:
    ctx = context(arch, n_rs_seq=0)
    decode(ctx, PROMPT[:20], 0)
    decode(ctx, [PROMPT[20]], 20)
    assert ctx.memory.seq_rm(0, 20, -1) is False  # as llama.cpp with n_rs_seq = 0
    assert ctx.memory.seq_pos_max(0) == 20
    with pytest.raises(kvtool.DecodeError):  # positions must continue at 21
        decode(ctx, [5], 20)


@pytest.mark.parametrize("arch", ARCHS)
def test_failed_decode_leaves_the_states_as_before(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = context(arch, n_rs_seq=0, n_ubatch=4)
    decode(ctx, PROMPT[:6], 0, seq=0)
    decode(ctx, PROMPT[6:9], 0, seq=1)
    impl = model(arch).impl
    calls = {"n": 0}
    real = impl.block

    def failing(il: int, h: torch.Tensor, ub, view):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:  # second ubatch, after some layers stored their states
            raise RuntimeError("boom")
        return real(il, h, ub, view)

    monkeypatch.setattr(impl, "block", failing)
    b = kvtool.Batch()
    for i in range(8):
        b.add(PROMPT[10 + i], 6 + i, [0], True)
    with pytest.raises(RuntimeError):
        ctx.decode(b)
    monkeypatch.undo()
    assert (ctx.memory.seq_pos_max(0), ctx.memory.seq_pos_max(1)) == (5, 2)
    got = decode(ctx, PROMPT[10:12], 6)
    fresh = context(arch, n_rs_seq=0)
    close(got, decode(fresh, [*PROMPT[:6], *PROMPT[10:12]], 0)[-2:])


def test_states_do_not_cross_between_recurrent_and_kv_models() -> None:
    rec = context("mamba", n_rs_seq=0)
    decode(rec, PROMPT[:5], 0)
    kv = kvtool.Context(
        kvtool.Model(DATA / "models" / "tiny-llama.gguf"), kvtool.ContextParams(n_ctx=256, n_seq_max=2)
    )
    decode(kv, PROMPT[:5], 0)
    with pytest.raises(kvtool.StateError):
        kv.state_seq_set_data(rec.state_seq_get_data(0), 1)
    with pytest.raises(kvtool.StateError):
        rec.state_seq_set_data(kv.state_seq_get_data(0), 1)
    assert kv.memory.seq_pos_max(1) == -1 and rec.memory.seq_pos_max(1) == -1
