"""What the memory property tests (test_property_memory.py) found, as explicit programs: each
failed before its fix. A hybrid memory must keep its two parts holding the same tokens: its
recurrent part, as llama.cpp's, only looks at a state's last position when given a range
(removing a range before it removes nothing, copying copies the whole state), so the hybrid
refuses the ranges its KV part would cut alone."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import kvtool
from kvtool import Batch, Context, ContextParams
from kvtool.memory.base import MemoryRefused
from tests.helpers.memory_snapshot import snapshot

TINY = Path(__file__).parent.parent.parent / "data" / "tiny" / "models"


@functools.cache
def model(arch: str) -> kvtool.Model:
    return kvtool.Model(TINY / f"tiny-{arch}.gguf")


def context(arch: str, unified: bool = True, n_seq: int = 3) -> Context:
    ctx = Context(
        model(arch), ContextParams(n_ctx=256 * (1 if unified else n_seq), n_seq_max=n_seq, kv_unified=unified)
    )
    ctx.decode(Batch.from_tokens([3, 4, 5, 6], seq_id=0, pos0=0))
    return ctx


@pytest.mark.parametrize(("p0", "p1"), [(-1, 1), (0, 2), (1, 3)])
def test_hybrid_seq_rm_of_a_range_before_the_last_position_is_refused(p0: int, p1: int) -> None:
    """seq_rm(0, -1, 1) on tokens 0..3 answered True: the recurrent state kept token 0 while
    the KV cache dropped it."""
    ctx = context("granitehybrid")
    before = snapshot(ctx.memory)
    assert ctx.memory.seq_rm(0, p0, p1) is False
    assert snapshot(ctx.memory) == before


def test_recurrent_seq_div_by_zero_is_refused() -> None:
    """seq_div(0, -1, -1, 0) raised ZeroDivisionError (a traceback) when it ran."""
    ctx = context("mamba")
    before = snapshot(ctx.memory)
    with pytest.raises(MemoryRefused):
        ctx.memory.seq_div(0, -1, -1, 0)
    assert snapshot(ctx.memory) == before


def test_recurrent_seq_add_below_zero_frees_the_state() -> None:
    """seq_add(0, -1, -1, -10) left sequence 0 at position -7 (neither empty nor valid); KV
    cells pushed below 0 are freed, and so is a state now."""
    ctx = context("mamba")
    ctx.memory.seq_add(0, -1, -1, -10)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0), ctx.memory.n_used()) == (-1, -1, 0)
    ctx.decode(Batch.from_tokens([7], seq_id=0, pos0=0))  # a fresh start
    assert ctx.memory.seq_pos_max(0) == 0


@pytest.mark.parametrize(("p0", "p1"), [(1, -1), (0, 2), (5, -1)])
def test_hybrid_seq_cp_of_part_of_a_sequence_is_refused(p0: int, p1: int) -> None:
    """seq_cp(0, 1, 0, 2) gave sequence 1 the whole recurrent state of tokens 0..3 and the
    KV cells of positions 0..1 only."""
    ctx = context("granitehybrid")
    before = snapshot(ctx.memory)
    with pytest.raises(MemoryRefused):
        ctx.memory.seq_cp(0, 1, p0, p1)
    assert snapshot(ctx.memory) == before


@pytest.mark.parametrize("unified", [True, False])
def test_hybrid_seq_cp_replaces_the_destination(unified: bool) -> None:
    """In one stream, seq_cp(0, 1, -1, -1) over a non-empty sequence 1 kept 1's own KV cells
    beside the copy while its recurrent state became 0's: the next decode then attended over
    both histories. The copy now replaces sequence 1 in both parts: its logits are 0's."""
    ctx = context("granitehybrid", unified)
    ctx.decode(Batch.from_tokens([9, 10, 11, 12, 13, 14], seq_id=1, pos0=0))
    ctx.memory.seq_cp(0, 1, -1, -1)
    assert ctx.memory.n_used() == (4 if unified else 8)
    b = Batch()
    b.add(20, 4, [0], True)
    b.add(20, 4, [1], True)
    ctx.decode(b)
    assert ctx.logits()[0].tolist() == ctx.logits()[1].tolist()


def test_hybrid_seq_rm_of_an_unknown_sequence_answers_false() -> None:
    """seq_rm(3, 0, 3) with n_seq_max = 3 raised IndexError in split mode (found with the
    hybrid's own range check, before it was merged)."""
    ctx = context("granitehybrid", unified=False)
    assert ctx.memory.seq_rm(3, 0, 3) is False
