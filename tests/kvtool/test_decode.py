"""Chunked decoding and resuming a sequence (kvtool.decode): the reference is one decode of
the same tokens in a fresh context, which must give the same logits and the same cells."""

from __future__ import annotations

import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams

TOKENS = [(i * 11) % 90 + 5 for i in range(40)]


def fresh(model: kvtool.Model, n_batch: int = 512, n_ctx: int = 256) -> Context:
    return Context(model, ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_batch, 512)))


def reference(model: kvtool.Model, tokens: list[int]) -> torch.Tensor:
    ctx = fresh(model)
    ctx.decode(Batch.from_tokens(tokens))
    return ctx.logits_ith(-1)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_decode_tokens_in_chunks_equals_one_decode(tiny_llama: kvtool.Model) -> None:
    ctx = fresh(tiny_llama, n_batch=7)
    n0 = ctx.n_decoded
    close(kvtool.decode_tokens(ctx, TOKENS, 0, 0), reference(tiny_llama, TOKENS))
    assert ctx.n_decoded - n0 == len(TOKENS)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, len(TOKENS) - 1)


def test_decode_tokens_that_do_not_fit_decode_nothing(tiny_llama: kvtool.Model) -> None:
    ctx = fresh(tiny_llama, n_batch=16)
    kvtool.decode_tokens(ctx, TOKENS[:10], 0, 0)
    with pytest.raises(kvtool.ContextFullError, match="needs 266 positions"):
        kvtool.decode_tokens(ctx, [5] * 256, 0, 10)
    assert ctx.memory.seq_pos_max(0) == 9


def test_decode_batch_splits_a_batch_of_several_sequences(tiny_llama: kvtool.Model) -> None:
    ctx = Context(tiny_llama, ContextParams(n_ctx=512, n_batch=6, n_seq_max=2))
    b = Batch()
    for s in (0, 1):
        for i, t in enumerate(TOKENS[:10]):
            b.add(t + s, i, (s,), s == 1 and i == 9)
    kvtool.decode_batch(ctx, b)
    assert [ctx.memory.seq_pos_max(s) for s in (0, 1)] == [9, 9]
    close(ctx.logits_ith(-1), reference(tiny_llama, [t + 1 for t in TOKENS[:10]]))


def test_resume_keeps_the_common_prefix_and_decodes_the_rest(tiny_llama: kvtool.Model) -> None:
    ctx = fresh(tiny_llama, n_batch=8)
    kvtool.decode_tokens(ctx, TOKENS[:30], 0, 0)
    edited = [*TOKENS[:12], 7, 8, 9]
    n0 = ctx.n_decoded
    kept, logits = kvtool.resume_seq(ctx, 0, edited, TOKENS[:30])
    assert kept == 12 and ctx.n_decoded - n0 == 3
    assert ctx.memory.seq_pos_max(0) == len(edited) - 1
    close(logits, reference(tiny_llama, edited))
    kept, logits = kvtool.resume_seq(ctx, 0, edited, edited)  # nothing new: the last token again
    assert kept == len(edited) - 1
    close(logits, reference(tiny_llama, edited))


def test_resume_cuts_cells_the_caller_does_not_know(tiny_llama: kvtool.Model) -> None:
    """After a decode the caller never recorded (a failed turn), the memory holds more than
    `held` says; what it holds past the kept prefix must go, not trip the Y = X + 1 rule."""
    ctx = fresh(tiny_llama)
    ctx.decode(Batch.from_tokens([5, 6, 7, 8]))
    kept, logits = kvtool.resume_seq(ctx, 0, TOKENS[:6], [])
    assert kept == 0 and ctx.memory.seq_pos_max(0) == 5
    close(logits, reference(tiny_llama, TOKENS[:6]))


def test_resume_keeps_no_more_than_the_memory_holds(tiny_llama: kvtool.Model) -> None:
    ctx = fresh(tiny_llama)
    kvtool.decode_tokens(ctx, TOKENS[:4], 0, 0)
    kept, logits = kvtool.resume_seq(ctx, 0, TOKENS[:10], TOKENS[:10])  # `held` claims ten
    assert kept == 4
    close(logits, reference(tiny_llama, TOKENS[:10]))


def test_resume_that_does_not_fit_changes_nothing(tiny_llama: kvtool.Model) -> None:
    ctx = fresh(tiny_llama)
    kvtool.decode_tokens(ctx, TOKENS[:10], 0, 0)
    with pytest.raises(kvtool.ContextFullError):
        kvtool.resume_seq(ctx, 0, [5] * 257, TOKENS[:10])
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, 9)


def test_a_resume_that_fails_part_way_leaves_the_kept_prefix(
    tiny_llama: kvtool.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = fresh(tiny_llama, n_batch=4)
    kvtool.decode_tokens(ctx, TOKENS[:8], 0, 0)
    real, calls = ctx.decode, []

    def second_view_fails(batch: Batch) -> None:
        calls.append(len(batch))
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(batch)

    monkeypatch.setattr(ctx, "decode", second_view_fails)
    with pytest.raises(KeyboardInterrupt):
        kvtool.resume_seq(ctx, 0, TOKENS[:5] + [9] * 10, TOKENS[:8])
    assert ctx.memory.seq_pos_max(0) == 4  # the first view went in and was taken out again


def test_set_n_threads_sets_and_reports() -> None:
    before = kvtool.set_n_threads()
    try:
        assert kvtool.set_n_threads(1) == 1 == torch.get_num_threads()
        assert kvtool.set_n_threads(None) == 1  # None keeps the current number
    finally:
        torch.set_num_threads(before)
    for bad in (-2, 513, 100_000):  # OpenMP aborted at 20,000 and crashed at 100,000
        with pytest.raises(kvtool.KvtoolError, match=r"in \[1, 512\]"):
            kvtool.set_n_threads(bad)
    with pytest.raises(TypeError):
        kvtool.set_n_threads(2.5)  # type: ignore[arg-type]
