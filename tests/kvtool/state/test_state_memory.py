"""Where restored cells go: other sequence ids, the other KV mode, other n_ctx / n_seq_max,
scattered free cells, shared cells, pending shifts. The reference is always the continuation
the saving context computes itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtool
from kvtool import Batch
from kvtool.errors import StateError
from kvtool.state import inspect

TOL = dict(rtol=1e-4, atol=1e-4)


def next_logits(ctx: kvtool.Context, seq: int, tok: int = 5) -> torch.Tensor:
    ctx.decode(Batch.from_tokens([tok], seq_id=seq, pos0=ctx.memory.seq_pos_max(seq) + 1))
    return ctx.logits_ith(-1).clone()


@pytest.mark.parametrize("src_unified", [True, False])
@pytest.mark.parametrize(
    ("unified", "n_ctx", "n_seq_max", "dest"),
    [(True, 512, 4, 3), (False, 512, 4, 3), (True, 256, 1, 0), (False, 1024, 2, 1), (False, 256, 8, 7)],
)
def test_sequence_loads_anywhere_it_fits(  # type: ignore[no-untyped-def]
    model, ctx_of, tokens, src_unified, unified, n_ctx, n_seq_max, dest
) -> None:
    src = ctx_of(model, src_unified)
    kvtool.decode_tokens(src, tokens(model, 9, seed=1), 0, 0)
    kvtool.decode_tokens(src, tokens(model, 14), 1, 0)
    data = src.state_seq_get_data(1)
    want = next_logits(src, 1)
    dst = ctx_of(model, unified, n_ctx=n_ctx, n_seq_max=n_seq_max)
    info = dst.state_seq_set_data(data, dest)
    assert info.kind == "sequence" and info.seqs[0].seq_id == 1
    assert dst.memory.seq_pos_max(dest) == 13
    torch.testing.assert_close(next_logits(dst, dest), want, **TOL)


def test_sequence_fills_scattered_free_cells(tiny_llama, ctx_of, tokens) -> None:  # type: ignore[no-untyped-def]
    src = ctx_of(tiny_llama, True)
    kvtool.decode_tokens(src, tokens(tiny_llama, 12), 0, 0)
    data = src.state_seq_get_data(0)
    want = next_logits(src, 0)
    dst = ctx_of(tiny_llama, True, n_ctx=256, n_seq_max=3)
    kvtool.decode_tokens(dst, tokens(tiny_llama, 250, seed=4), 1, 0)
    dst.memory.seq_rm(1, 100, 104)  # free: 4 + 6 + 6 cells, never 12 in a row
    dst.memory.seq_rm(1, 200, 206)
    dst.state_seq_set_data(data, 2)
    cells = dst.memory.cells[0]
    where = np.flatnonzero(cells.has_seq(2))
    assert sorted(cells.pos[where].tolist()) == list(range(12))
    assert set(range(100, 104)) <= set(where.tolist())
    assert dst.memory.seq_pos_max(1) == 249
    torch.testing.assert_close(next_logits(dst, 2), want, **TOL)


@pytest.mark.parametrize("src_unified", [True, False])
@pytest.mark.parametrize("unified", [True, False])
def test_context_with_shared_cells_loads_into_either_mode(  # type: ignore[no-untyped-def]
    model, ctx_of, tokens, src_unified, unified
) -> None:
    src = ctx_of(model, src_unified)
    kvtool.decode_tokens(src, tokens(model, 10), 0, 0)
    src.memory.seq_cp(0, 1, -1, -1)  # shared cells in one stream, copies across streams
    kvtool.decode_tokens(src, tokens(model, 3, seed=2), 1, 10)
    kvtool.decode_tokens(src, tokens(model, 6, seed=3), 3, 0)
    data = src.state_get_data()
    info = inspect(data)
    expect = [(s, src.memory.seq_pos_min(s), src.memory.seq_pos_max(s)) for s in (0, 1, 3)]
    assert [(s.seq_id, s.pos_min, s.pos_max) for s in info.seqs] == expect
    want = {s: next_logits(src, s) for s in (0, 1, 3)}
    dst = ctx_of(model, unified, n_ctx=1024)
    dst.state_set_data(data)
    assert [(s, dst.memory.seq_pos_min(s), dst.memory.seq_pos_max(s)) for s in (0, 1, 3)] == expect
    for s in (0, 1, 3):
        torch.testing.assert_close(next_logits(dst, s), want[s], **TOL)
    assert dst.memory.seq_pos_max(2) == -1


def test_pending_shift_survives(tiny_llama, ctx_of, tokens) -> None:  # type: ignore[no-untyped-def]
    src = ctx_of(tiny_llama, False)
    kvtool.decode_tokens(src, tokens(tiny_llama, 16), 0, 0)
    src.memory.seq_rm(0, 2, 6)
    src.memory.seq_add(0, 6, -1, -4)  # K re-rotation pending until the next decode
    data = src.state_seq_get_data(0)
    want = next_logits(src, 0)
    dst = ctx_of(tiny_llama, True)
    dst.state_seq_set_data(data, 1)
    assert dst.memory.seq_pos_max(1) == 11
    torch.testing.assert_close(next_logits(dst, 1), want, **TOL)


@pytest.mark.parametrize("unified", [True, False])
def test_sequence_with_two_tokens_at_one_position_round_trips(tiny_llama, ctx_of, tokens, unified) -> None:  # type: ignore[no-untyped-def]
    """Self-extend's seq_div leaves two cells of a sequence at each divided position (llama.cpp
    saves and restores such a sequence): a state kvtool wrote, it must read back."""
    src = ctx_of(tiny_llama, unified)
    kvtool.decode_tokens(src, tokens(tiny_llama, 12), 0, 0)
    src.memory.seq_div(0, 4, -1, 2)  # positions 4..11 -> 2, 2, 3, 3, 4, 4, 5, 5
    seq_state, ctx_state = src.state_seq_get_data(0), src.state_get_data()
    want = next_logits(src, 0)
    for load in (lambda c: c.state_seq_set_data(seq_state, 1), lambda c: c.state_set_data(ctx_state)):
        dst = ctx_of(tiny_llama, not unified)
        load(dst)
        s = 1 if dst.memory.seq_pos_max(1) >= 0 else 0
        assert (dst.memory.seq_pos_min(s), dst.memory.seq_pos_max(s), dst.n_used_cells()) == (0, 5, 12)
        torch.testing.assert_close(next_logits(dst, s), want, **TOL)


def test_loading_replaces_the_destination(tiny_llama, ctx_of, tokens) -> None:  # type: ignore[no-untyped-def]
    src = ctx_of(tiny_llama, False)
    empty = src.state_seq_get_data(2)
    assert inspect(empty).seqs[0].n_cells == 0
    kvtool.decode_tokens(src, tokens(tiny_llama, 8), 2, 0)
    src.state_seq_set_data(empty, 2)
    assert src.memory.seq_pos_max(2) == -1 and src.n_used_cells() == 0


def test_token_lists_need_one_sequence(tiny_llama, ctx_of, tokens) -> None:  # type: ignore[no-untyped-def]
    ctx = ctx_of(tiny_llama, True)
    kvtool.decode_tokens(ctx, tokens(tiny_llama, 4), 0, 0)
    assert inspect(ctx.state_get_data(tokens=[1, 2, 3, 4])).tokens(0) == [1, 2, 3, 4]
    kvtool.decode_tokens(ctx, tokens(tiny_llama, 4), 1, 0)
    with pytest.raises(StateError, match="exactly one sequence"):
        ctx.state_get_data(tokens=[1, 2, 3, 4])
    assert inspect(ctx.state_get_data(tokens={1: [9]})).tokens(1) == [9]


def test_window_cache_sequence_state_keeps_what_the_window_sees(tiny_gemma3, ctx_of, tokens) -> None:  # type: ignore[no-untyped-def]
    src = ctx_of(tiny_gemma3, True)
    kvtool.decode_tokens(src, tokens(tiny_gemma3, 20), 0, 0)
    info = inspect(src.state_seq_get_data(0))
    assert info.memory["parts"]["swa"]["swa"]["n_swa"] == 8  # the oracle's tiny gemma3 (README section 3)
    assert info.memory["parts"]["swa"]["n_rows"] == 8  # positions 12..19: what a query at 20 sees
    assert info.memory["parts"]["base"]["n_rows"] == 20
    assert inspect(src.state_get_data()).memory["parts"]["swa"]["n_rows"] == 20  # context: every cell


def test_app_data_must_be_json(tiny_llama, ctx_of) -> None:  # type: ignore[no-untyped-def]
    ctx = ctx_of(tiny_llama, True)
    with pytest.raises(StateError, match="not plain JSON"):
        ctx.state_get_data(app={"when": object()})
    assert inspect(ctx.state_get_data(app={"note": "ünïcode"})).app == {"note": "ünïcode"}
