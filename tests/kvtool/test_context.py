"""Context.decode on a tiny random llama: batching, forks, cuts and failures must not change
what a sequence computes (the reference is the same tokens decoded alone in a fresh context).
Position shifts are tested in test_context_shift.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams, DecodeError

TOL = dict(rtol=1e-4, atol=1e-4)


def fresh(model, unified: bool = True, n_ctx: int = 256, n_seq_max: int = 4) -> Context:  # type: ignore[no-untyped-def]
    return Context(
        model, ContextParams(n_ctx=n_ctx, n_batch=256, n_ubatch=256, n_seq_max=n_seq_max, kv_unified=unified)
    )


def alone(model, tokens: list[int], pos0: int = 0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ctx = fresh(model)
    ctx.decode(Batch.from_tokens(tokens, pos0=pos0, logits="all"))
    return ctx.logits().clone()


def prompts(n: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, n, size=k).tolist() for k in lens]


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("n_ubatch", [256, 3])
def test_interleaved_batch_equals_separate_decodes(tiny_llama, unified: bool, n_ubatch: int) -> None:  # type: ignore[no-untyped-def]
    ps = prompts(tiny_llama.n_vocab, [5, 11, 7, 2])
    ctx = Context(tiny_llama, ContextParams(n_ctx=256, n_ubatch=n_ubatch, n_seq_max=4, kv_unified=unified))
    b = Batch()
    where = []
    for i in range(max(map(len, ps))):
        for s, p in enumerate(ps):
            if i < len(p):
                where.append((s, i))
                b.add(p[i], i, [s], True)
    ctx.decode(b)
    ref = [alone(tiny_llama, p) for p in ps]
    got = ctx.logits()
    for row, (s, i) in enumerate(where):
        torch.testing.assert_close(got[row], ref[s][i], **TOL)
        torch.testing.assert_close(ctx.logits_ith(row), ref[s][i], **TOL)


@pytest.mark.parametrize("unified", [True, False])
def test_fork_with_seq_cp(tiny_llama, unified: bool) -> None:  # type: ignore[no-untyped-def]
    (p,) = prompts(tiny_llama.n_vocab, [9], seed=1)
    ctx = fresh(tiny_llama, unified)
    ctx.decode(Batch.from_tokens(p))
    ctx.memory.seq_cp(0, 1, -1, -1)
    b = Batch()
    b.add(10, 9, [0], True)
    b.add(20, 9, [1], True)
    ctx.decode(b)
    torch.testing.assert_close(ctx.logits()[0], alone(tiny_llama, [*p, 10])[-1], **TOL)
    torch.testing.assert_close(ctx.logits()[1], alone(tiny_llama, [*p, 20])[-1], **TOL)


@pytest.mark.parametrize("unified", [True, False])
def test_partial_seq_cp_then_continue(tiny_llama, unified: bool) -> None:  # type: ignore[no-untyped-def]
    (p,) = prompts(tiny_llama.n_vocab, [12], seed=2)
    ctx = fresh(tiny_llama, unified)
    ctx.decode(Batch.from_tokens(p))
    ctx.memory.seq_cp(0, 2, 0, 6)  # seq 2 gets positions 0..5 only
    assert (ctx.memory.seq_pos_min(2), ctx.memory.seq_pos_max(2)) == (0, 5)
    ctx.decode(Batch.from_tokens([30, 31], seq_id=2, pos0=6, logits="all"))
    torch.testing.assert_close(ctx.logits(), alone(tiny_llama, [*p[:6], 30, 31])[-2:], **TOL)


def test_rm_tail_then_new_tokens(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    (p,) = prompts(tiny_llama.n_vocab, [16], seed=3)
    ctx = fresh(tiny_llama)
    ctx.decode(Batch.from_tokens(p))
    assert ctx.memory.seq_rm(0, 10, -1)
    ctx.decode(Batch.from_tokens([7, 8, 9], pos0=10, logits="all"))
    torch.testing.assert_close(ctx.logits(), alone(tiny_llama, [*p[:10], 7, 8, 9])[-3:], **TOL)


def test_full_cache_fails_without_side_effects(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    ctx = Context(tiny_llama, ContextParams(n_ctx=256, n_seq_max=1, kv_unified=True))
    ctx.decode(Batch.from_tokens(list(range(3, 203))))
    before = ctx.memory.seq_pos_max(0), ctx.n_used_cells()
    with pytest.raises(DecodeError) as e:
        ctx.decode(Batch.from_tokens(list(range(3, 103)), pos0=200))
    assert e.value.status == 1
    assert (ctx.memory.seq_pos_max(0), ctx.n_used_cells()) == before
    ctx.decode(Batch.from_tokens([5], pos0=200))  # still usable, and computes what it would have
    torch.testing.assert_close(ctx.logits()[-1], alone(tiny_llama, [*range(3, 203), 5])[-1], **TOL)


def test_invalid_batch_leaves_memory(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    ctx = fresh(tiny_llama)
    ctx.decode(Batch.from_tokens([5, 6, 7]))
    with pytest.raises(DecodeError):
        ctx.decode(Batch.from_tokens([8], pos0=1))
    assert ctx.memory.seq_pos_max(0) == 2


def test_interrupted_decode_rolls_back(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ctx = fresh(tiny_llama)
    ctx.decode(Batch.from_tokens([5, 6, 7]))

    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(ctx.model, "forward", boom)
    with pytest.raises(KeyboardInterrupt):
        ctx.decode(Batch.from_tokens([8, 9], pos0=3))
    assert ctx.memory.seq_pos_max(0) == 2
    monkeypatch.undo()
    ctx.decode(Batch.from_tokens([10, 11], pos0=3, logits="all"))  # no trace of the lost batch
    torch.testing.assert_close(ctx.logits(), alone(tiny_llama, [5, 6, 7, 10, 11])[-2:], **TOL)


def test_n_ctx_per_stream(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    split = Context(tiny_llama, ContextParams(n_ctx=1024, n_seq_max=4))
    assert split.n_ctx_seq == 256 and split.n_ctx == 1024
    with pytest.warns(UserWarning, match="not divisible"):
        odd = Context(tiny_llama, ContextParams(n_ctx=1000, n_seq_max=3))
    assert odd.n_ctx_seq == 512
    uni = Context(tiny_llama, ContextParams(n_ctx=1000, n_seq_max=3, kv_unified=True))
    assert uni.n_ctx_seq == 1024


def test_public_api_names() -> None:
    for name in [
        "load_model",
        "Context",
        "ContextParams",
        "Batch",
        "DecodeError",
        "Sampler",
        "SamplerParams",
    ]:
        assert hasattr(kvtool, name)


@pytest.mark.parametrize("unified", [True, False])
def test_attention_spans_cells_in_use_per_stream(tiny_llama, unified: bool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """n_kv grows with the cells in use, not the cache size; split mode attends per stream."""
    import kvtool.backend.ops as backend

    seen = []
    real = backend.attention

    def spy(q, k, v, mask, scale, tk, tv, compiled, softcap):  # type: ignore[no-untyped-def]
        seen.append((tuple(q.shape[:2]), tuple(k.shape[:2])))
        return real(q, k, v, mask, scale, tk, tv, compiled=compiled, softcap=softcap)

    monkeypatch.setattr(backend, "attention", spy)
    ctx = Context(tiny_llama, ContextParams(n_ctx=1024, n_seq_max=4, kv_unified=unified))
    b = Batch()
    for s in range(4):
        for i in range(5):
            b.add(10 + i, i, [s], True)
    ctx.decode(b)
    n_layer = tiny_llama.hparams.n_layer
    assert len(seen) == n_layer
    if unified:
        assert seen[0] == ((1, 20), (1, 20))  # one stream, 20 cells used of 1024
    else:
        assert seen[0] == ((4, 5), (4, 5))  # four streams of 256 cells, 5 used in each


def test_split_mode_rejects_a_token_shared_by_sequences(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    ctx = Context(tiny_llama, ContextParams(n_ctx=512, n_seq_max=2))
    b = Batch()
    b.add(5, 0, [0, 1], True)
    with pytest.raises(DecodeError, match="kv-unified"):
        ctx.decode(b)
    uni = Context(tiny_llama, ContextParams(n_ctx=512, n_seq_max=2, kv_unified=True))
    uni.decode(b)
    assert uni.memory.seq_pos_max(1) == 0


def test_logits_of_one_ubatch_in_order_are_taken_without_a_copy(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """A batch computed in one ubatch whose outputs come in batch order keeps the forward's
    tensor; reordered (split streams) or several ubatches are gathered into batch order."""
    from kvtool.context import _in_batch_order

    rows = torch.randn(3, 5)
    assert _in_batch_order([(np.arange(3), rows)], 3, 5) is rows
    got = _in_batch_order([(np.array([2, 0, 1]), rows)], 3, 5)
    assert torch.equal(got, rows[[1, 2, 0]])
    got = _in_batch_order([(np.array([0]), rows[:1]), (np.array([1, 2]), rows[1:])], 3, 5)
    assert torch.equal(got, rows)
    ctx = fresh(tiny_llama, unified=False)
    b = Batch()
    for s in (2, 0, 1):  # sequences out of stream order: the ubatch orders them by sequence
        b.add(5 + s, 0, (s,), True)
    ctx.decode(b)
    for i, s in enumerate((2, 0, 1)):
        torch.testing.assert_close(ctx.logits()[i], alone(tiny_llama, [5 + s])[-1], rtol=1e-5, atol=1e-5)
