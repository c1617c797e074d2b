"""Sequence operations over quantized caches move blocks as they are: seq_cp across streams
(whole and partial), compaction, a hybrid's attention part and a sliding-window pair hold and
report blocks of their types."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams
from kvtool.kernels.kv_quant import KV_TYPES
from kvtool.memory.hybrid import HybridSpec
from kvtool.memory.kv_cache import KVLayerSpec
from kvtool.memory.recurrent import RecurrentSpec, RSLayerSpec
from kvtool.memory.spec import KVSpec, MemoryParams

GEMMA3 = Path(__file__).parents[2] / "data" / "tiny" / "models" / "tiny-gemma3.gguf"  # heads of 32


@pytest.fixture(scope="module")
def gemma3() -> kvtool.Model:
    return kvtool.Model(GEMMA3)


def rows_by_pos(cache, seq: int) -> dict[int, tuple[bytes, ...]]:  # type: ignore[no-untyped-def]
    """position -> the bytes of that cell's K and V rows in every layer."""
    s = cache.stream_of(seq)
    c = cache.cells[s]
    out = {}
    for i in np.flatnonzero(c.has_seq(seq)):
        out[int(c.pos[i])] = tuple(
            bytes(t[s, i].contiguous().view(torch.uint8).numpy())
            for il in sorted(cache.k)
            for t in (cache.k[il], cache.v[il])
        )
    return out


@pytest.mark.parametrize(("p0", "p1"), [(-1, -1), (3, 11)])
def test_seq_cp_across_streams_copies_blocks(gemma3: kvtool.Model, p0: int, p1: int) -> None:
    ctx = Context(gemma3, ContextParams(n_ctx=1024, n_seq_max=4, swa_full=True, type_k="q4_0", type_v="q8_0"))
    ctx.decode(Batch.from_tokens(list(range(5, 25)), seq_id=0))
    ctx.memory.seq_cp(0, 2, p0, p1)
    for part in ctx.memory.parts.values():
        assert {t.dtype for t in part.k.values()} == {torch.uint8}
        src, dst = rows_by_pos(part, 0), rows_by_pos(part, 2)
        want = {p: r for p, r in src.items() if (p0 < 0 or p0 <= p < p1)}
        assert dst == want
    if p0 < 0:  # the whole sequence, in the same cells of its own stream: the same next logits
        ctx.decode(Batch.from_tokens([7], seq_id=0, pos0=20))
        a = ctx.logits().clone()
        ctx.decode(Batch.from_tokens([7], seq_id=2, pos0=20))
        assert torch.equal(a, ctx.logits())


def test_compaction_moves_blocks_unchanged(gemma3: kvtool.Model) -> None:
    ctx = Context(
        gemma3,
        ContextParams(n_ctx=256, n_seq_max=3, kv_unified=True, swa_full=True, type_k="iq4_nl", type_v="q5_1"),
    )
    for s in range(3):
        ctx.decode(Batch.from_tokens(list(range(10 + s, 40 + s)), seq_id=s))
    ctx.memory.seq_rm(1, -1, -1)  # a hole in the middle of the stream
    before = {s: [rows_by_pos(p, s) for p in ctx.memory.parts.values()] for s in (0, 2)}
    assert ctx.update(optimize=True)
    base = ctx.memory.parts["base"]
    assert base.cells[0].used_max_p1() == base.cells[0].n_used() == 60  # packed
    assert {s: [rows_by_pos(p, s) for p in ctx.memory.parts.values()] for s in (0, 2)} == before


def test_a_hybrids_attention_part_holds_blocks() -> None:
    spec = HybridSpec(
        KVSpec({0: KVLayerSpec(2, 64, 64), 2: KVLayerSpec(2, 64, 64)}),
        RecurrentSpec({1: RSLayerSpec((3, 8), (8, 4))}),
    )
    p = MemoryParams(
        n_ctx_seq=256, n_seq_max=2, n_ubatch=32, type_k=KV_TYPES["q8_0"], type_v=KV_TYPES["q4_1"]
    )
    mem = spec.build(p)
    attn = mem.attn
    assert {tuple(t.shape) for t in attn.k.values()} == {(2, 256, 2, 68)}  # two q8_0 blocks per head
    assert {tuple(t.shape) for t in attn.v.values()} == {(2, 256, 2, 40)}
    assert (attn.rot_k, attn.rot_v) == (64, 64)
    assert mem.memory_breakdown() == spec.memory_breakdown(p)
    with pytest.raises(
        kvtool.KvtoolError, match="V cache type q4_1 with block size 32 does not divide n_embd_head_v=48"
    ):
        HybridSpec(KVSpec({0: KVLayerSpec(2, 64, 48)}), RecurrentSpec({})).memory_breakdown(p)
