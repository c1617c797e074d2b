"""KV compaction in the engine (ContextParams.defrag): the moved cells compute what they did.

Attention sums over cells in cell order, so a compacted cache is compared, bit for bit, with a
reference whose cells hold the same tokens in the same order, built by another road: state
save/load, which places a context's (or a sequence's) cells one after another in a fresh
context. The fragmentations below are chosen so that the planner's result (used cells past
`n_used` fill the holes, lowest first) is known: the reference loads the sequences in that
order. K, V, the cell metadata and the next decode's logits must then be identical.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams, DecodeError
from kvtool.memory.defrag import DefragPolicy
from kvtool.memory.kv_cache import KVCache
from kvtool.memory.kv_cells import KVCells


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def toks(n: int, seed: int, n_vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, n_vocab, n)]


def fill(ctx: Context, seqs: dict[int, int]) -> None:
    """Decodes `n` tokens on each sequence, one decode per sequence, in the dict's order."""
    for s, n in seqs.items():
        ctx.decode(Batch.from_tokens(toks(n, 100 + s, ctx.model.n_vocab), seq_id=s, logits="none"))


def next_logits(ctx: Context, seqs: list[int]) -> torch.Tensor:
    """One more token on each sequence, in one batch: [len(seqs), n_vocab]."""
    b = Batch()
    for s in seqs:
        b.add(7 + s, ctx.memory.seq_pos_max(s) + 1, [s], True)
    ctx.decode(b)
    return ctx.logits().clone()


def cache(ctx: Context) -> KVCache:
    assert isinstance(ctx.memory, KVCache)
    return ctx.memory


def assert_same_cache(a: Context, b: Context) -> None:
    ca, cb = cache(a), cache(b)
    for s in range(ca.n_stream):
        np.testing.assert_array_equal(ca.cells[s].pos, cb.cells[s].pos)
        np.testing.assert_array_equal(ca.cells[s].seq, cb.cells[s].seq)
        used = torch.from_numpy(ca.cells[s].used())
        for il in ca.k:
            assert torch.equal(ca.k[il][s][used], cb.k[il][s][used])
            assert torch.equal(ca.v[il][s][used], cb.v[il][s][used])


def params(unified: bool, n_seq: int, **kw: object) -> ContextParams:
    return ContextParams(n_ctx=256 * (1 if unified else n_seq), n_seq_max=n_seq, kv_unified=unified, **kw)  # type: ignore[arg-type]


def copy_of(ctx: Context) -> Context:
    """A second context with the same cells at the same indices (a state keeps cell indices)."""
    b = Context(ctx.model, ctx.params)
    b.state_set_data(ctx.state_get_data())
    return b


def move_by_hand(ctx: Context, stream: int, src: range, dst: range) -> None:
    """The reference executor: cell by cell, every layer's K and V row and the metadata."""
    c = cache(ctx)
    cells = c.cells[stream]
    for i, j in zip(src, dst, strict=True):
        for t in (*c.k.values(), *c.v.values()):
            t[stream, j] = t[stream, i]
        cells.pos[j], cells.seq[j], cells.shift[j] = cells.pos[i], cells.seq[i], cells.shift[i]
        cells.pos[i], cells.seq[i], cells.shift[i] = -1, 0, 0


@pytest.mark.parametrize("max_moves", [1, 256])
def test_unified_compaction_moves_every_row(tiny_llama: kvtool.Model, max_moves: int) -> None:
    """Six sequences of 4 cells; removing 1 and 3 leaves holes at 4-7 and 12-15, which the
    cells of 4 and 5 fill (two block moves: two passes with max_moves=1). The order of the cells
    changes, so the reference is the same context moved by hand, cell by cell."""
    p = params(True, 6, defrag_max_moves=max_moves)
    a = Context(tiny_llama, p)
    fill(a, {s: 4 for s in range(6)})
    a.memory.seq_rm(1, -1, -1)
    a.memory.seq_rm(3, -1, -1)
    b = copy_of(a)
    assert cache(a).cells[0].used_max_p1() == 24
    assert a.update(optimize=True)
    assert cache(a).cells[0].used_max_p1() == 16 and cache(a).cells[0].head == 16
    move_by_hand(b, 0, range(16, 24), [*range(4, 8), *range(12, 16)])  # type: ignore[arg-type]
    cache(b).cells[0].head = 16
    assert_same_cache(a, b)
    assert torch.equal(next_logits(a, [0, 2, 4, 5]), next_logits(b, [0, 2, 4, 5]))


@pytest.mark.parametrize("unified", [True, False])
def test_compaction_after_a_context_shift_is_bit_exact(tiny_llama: kvtool.Model, unified: bool) -> None:
    """Sequences 1 then 0 (one stream each when not unified) hold 16 tokens; in sequence 0 (and
    1 when it has its own stream) positions 8-11 are removed and 12-15 shifted down (a context
    shift), and the last 4 cells of each fragmented stream move into its hole. Bit for bit
    against the same move by hand; within float noise against the uncompacted context, whose
    attention also sums over the holes' exact zeros, in another order."""
    p = params(unified, 2)
    a = Context(tiny_llama, p)
    fill(a, {1: 16, 0: 16})
    for s in [0] if unified else [0, 1]:
        a.memory.seq_rm(s, 8, 12)
        a.memory.seq_add(s, 12, -1, -4)
    assert a.update()  # the shift only: policy none never compacts by itself
    assert not a.update()
    b, holes = copy_of(a), copy_of(a)
    assert a.update(optimize=True)
    if unified:
        move_by_hand(b, 0, range(28, 32), range(24, 28))
        cache(b).cells[0].head = 28
    else:
        for s in (0, 1):
            move_by_hand(b, s, range(12, 16), range(8, 12))
            cache(b).cells[s].head = 12
    assert [c.used_max_p1() for c in cache(a).cells] == ([28] if unified else [12, 12])
    assert_same_cache(a, b)
    got = next_logits(a, [0, 1])
    assert torch.equal(got, next_logits(b, [0, 1]))
    torch.testing.assert_close(got, next_logits(holes, [0, 1]), rtol=1e-5, atol=1e-5)


def test_on_fail_compacts_when_no_contiguous_run_is_left(tiny_llama: kvtool.Model) -> None:
    """256 cells full of 8 sequences of 32; removing every other one leaves 128 free cells in
    runs of 32. A 64-token prompt needs one run: a contiguous policy that does not compact
    (threshold above the 50% of holes) fails, on-fail compacts and succeeds, with the logits of
    that prompt decoded alone."""
    prompt = toks(64, 7, tiny_llama.n_vocab)
    got = {}
    for policy in ("threshold=0.9", "on-fail"):
        ctx = Context(tiny_llama, params(True, 9, defrag=policy))
        fill(ctx, {s: 32 for s in range(8)})
        for s in (1, 3, 5, 7):
            ctx.memory.seq_rm(s, -1, -1)
        if policy != "on-fail":
            with pytest.raises(DecodeError, match="no room"):
                ctx.decode(Batch.from_tokens(prompt, seq_id=8))
            assert cache(ctx).cells[0].n_used() == 128  # nothing changed
            continue
        ctx.decode(Batch.from_tokens(prompt, seq_id=8))
        got[policy] = ctx.logits_ith(-1)
        assert cache(ctx).cells[0].used_max_p1() == 192
    alone = Context(tiny_llama, ContextParams(n_ctx=256))
    alone.decode(Batch.from_tokens(prompt))
    torch.testing.assert_close(got["on-fail"], alone.logits_ith(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("thold", "compacts"), [(0.4, False), (0.3, True)])
def test_threshold_compacts_only_above_the_fraction(
    tiny_llama: kvtool.Model, thold: float, compacts: bool
) -> None:
    """Three sequences of 8; removing the middle one leaves holes of 8 in a span of 24 (1/3)."""
    ctx = Context(tiny_llama, params(True, 3, defrag=f"threshold={thold}"))
    fill(ctx, {0: 8, 1: 8, 2: 8})
    ctx.memory.seq_rm(1, -1, -1)
    assert ctx.update() is compacts
    next_logits(ctx, [0])  # a decode runs the same update first
    assert cache(ctx).cells[0].used_max_p1() == (17 if compacts else 24)


def test_contiguous_slot_search() -> None:
    c = KVCells(16)
    c.pos[[0, 1, 4, 5, 6, 12]] = 0
    c.head = 2
    assert c.find_slot(2, contiguous=True).tolist() == [2, 3]
    assert c.find_slot(4, contiguous=True).tolist() == [7, 8, 9, 10]
    c.head = 13
    assert c.find_slot(4, contiguous=True).tolist() == [7, 8, 9, 10]  # wraps to the first run
    assert c.find_slot(6, contiguous=True) is None
    assert len(c.find_slot(6)) == 6  # non-contiguous


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("none", DefragPolicy()),
        ("on-fail", DefragPolicy("on-fail")),
        ("threshold=0.1", DefragPolicy("threshold", 0.1)),
    ],
)
def test_policy_parse(text: str, want: DefragPolicy) -> None:
    assert DefragPolicy.parse(text) == want


@pytest.mark.parametrize("bad", ["sometimes", "threshold", "threshold=x", "threshold=1.5", "on-fail=2"])
def test_bad_policy_is_a_kvtool_error(tiny_llama: kvtool.Model, bad: str) -> None:
    with pytest.raises(kvtool.KvtoolError):
        Context(tiny_llama, ContextParams(n_ctx=256, defrag=bad))
