"""HybridMemory on the tiny hybrid models (granitehybrid, lfm2): every seq op is all or nothing
across the KV part and the recurrent part, a partial seq_rm refused by the recurrent part leaves
the KV cache untouched (and succeeds in both with rollback snapshots), a failed batch is undone
in both, the batch split is the stricter of the two, and state files hold both parts, load all
or nothing, and reproduce the logits exactly within and across KV modes."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvtool
from kvtool.batch import Split
from kvtool.memory.base import Commit, MemoryRefused, SeqOp
from kvtool.memory.hybrid import HybridMemory, SWAKVPart
from kvtool.memory.kv_cache import KVCache
from kvtool.memory.kv_cells import SWAParams
from kvtool.memory.recurrent import RecurrentMemory
from kvtool.memory.sizes import MemoryBreakdown
from kvtool.memory.spec import MemoryParams
from kvtool.state.container import read_container, write_container
from tests.kvtool.memory.test_contract import OPS, _run

DATA = Path(__file__).parent.parent.parent / "data" / "tiny"
ARCHS = ["granitehybrid", "lfm2"]
PROMPT = [int(t) for t in np.random.default_rng(11).integers(3, 384, 24)]


@functools.cache
def model(arch: str) -> kvtool.Model:
    return kvtool.Model(DATA / "models" / f"tiny-{arch}.gguf")


def context(arch: str, unified: bool = True, n_rs_seq: int = 0, n_ubatch: int = 64) -> kvtool.Context:
    params = kvtool.ContextParams(
        n_ctx=512, n_batch=64, n_ubatch=n_ubatch, n_seq_max=2, kv_unified=unified, n_rs_seq=n_rs_seq
    )
    return kvtool.Context(model(arch), params)


def decode(ctx: kvtool.Context, tokens: list[int], pos0: int, seq: int = 0) -> torch.Tensor:
    b = kvtool.Batch()
    for i, t in enumerate(tokens):
        b.add(t, pos0 + i, [seq], True)
    ctx.decode(b)
    return ctx.logits().clone()


def snapshot(mem: HybridMemory) -> list[Any]:
    """Every cell, slot and tensor of both parts."""
    kv, rs = mem.attn, mem.recurrent
    assert isinstance(kv, KVCache) and isinstance(rs, RecurrentMemory)
    out: list[Any] = []
    for c in kv.cells:
        out += [c.pos.copy(), c.seq.copy(), c.shift.copy(), c.head, c.has_shift]
    out += [t.clone() for t in (*kv.k.values(), *kv.v.values())]
    out += [rs.cells.tail.copy(), rs.cells.pos.copy(), rs.cells.n_hist.copy()]
    out += [t.clone() for ts in rs.states.t.values() for t in ts.values()]
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, np.ndarray):
            return np.array_equal(x, y)
        return bool(x == y)

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_parts_and_split(arch: str) -> None:
    for unified, split in ((True, Split.EQUAL), (False, Split.EQUAL_SEQUENTIAL)):
        mem = context(arch, unified).memory
        assert isinstance(mem, HybridMemory) and mem.kind == "hybrid"
        assert mem.attn.layers == {1, 3} and mem.recurrent.layers == {0, 2}
        assert max(p.split for p in mem.parts.values()) == split  # what init_batch cuts with


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("part", ["recurrent", "attn"])
@pytest.mark.parametrize("op", OPS, ids=lambda o: type(o).__name__)
def test_a_part_refusing_any_op_leaves_both_parts_unchanged(
    monkeypatch: pytest.MonkeyPatch, unified: bool, part: str, op: SeqOp
) -> None:
    ctx = context("lfm2", unified)
    decode(ctx, PROMPT[:12], 0, seq=0)
    decode(ctx, PROMPT[12:17], 0, seq=1)
    mem = ctx.memory
    assert isinstance(mem, HybridMemory)
    before = snapshot(mem)

    def refuse(op: SeqOp) -> Commit:
        raise MemoryRefused("injected")

    # the other part plans (and would change) normally: only planning both first keeps it intact
    monkeypatch.setattr(mem.parts[part], "plan", refuse)
    _run(mem, op)
    assert same(before, snapshot(mem))


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_partial_seq_rm_refused_by_the_recurrent_part_keeps_the_kv_cache(arch: str, unified: bool) -> None:
    ctx = context(arch, unified)
    decode(ctx, PROMPT[:20], 0)
    mem = ctx.memory
    assert isinstance(mem, HybridMemory)
    assert mem.attn.seq_pos_min(0) == 0 and mem.recurrent.seq_pos_min(0) == 19
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (19, 19)  # as llama.cpp reports it
    before = snapshot(mem)
    assert mem.seq_rm(0, 10, -1) is False  # the KV part alone would accept it
    assert same(before, snapshot(mem))
    assert mem.seq_rm(0, -1, -1) is True  # a whole sequence always goes, from both
    assert mem.attn.seq_pos_max(0) == -1 and mem.recurrent.seq_pos_max(0) == -1


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_succeeds_in_both_parts(arch: str) -> None:
    ctx = context(arch, unified=False, n_rs_seq=3)
    decode(ctx, PROMPT[:20], 0)
    for i in range(3):  # pos 20, 21, 22
        decode(ctx, [PROMPT[20 + i]], 20 + i)
    mem = ctx.memory
    assert isinstance(mem, HybridMemory)
    assert mem.seq_rm(0, 10, -1) is False  # beyond the snapshots
    assert mem.attn.seq_pos_max(0) == 22
    assert mem.seq_rm(0, 21, -1) is True
    assert mem.attn.seq_pos_max(0) == 20 and mem.recurrent.seq_pos_max(0) == 20
    got = decode(ctx, [5, 6], 21)
    want = decode(context(arch, unified=False), [*PROMPT[:21], 5, 6], 0)[-2:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_failed_batch_is_undone_in_both_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = context("granitehybrid", unified=True, n_ubatch=4)
    decode(ctx, PROMPT[:6], 0)
    mem = ctx.memory
    assert isinstance(mem, HybridMemory)
    impl = ctx.model.impl
    real, calls = impl._attention, {"n": 0}

    def failing(*a: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:  # second ubatch: its Mamba-2 layer 0 already stored its state
            raise RuntimeError("boom")
        return real(*a)

    monkeypatch.setattr(impl, "_attention", failing)
    with pytest.raises(RuntimeError):
        decode(ctx, PROMPT[6:14], 6)
    monkeypatch.undo()
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (5, 5)
    got = decode(ctx, PROMPT[6:8], 6)
    assert mem.attn.n_used() == 8
    want = decode(context("granitehybrid"), PROMPT[:8], 0)[-2:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("src_unified", "dst_unified"), [(True, True), (False, False), (True, False), (False, True)]
)
@pytest.mark.parametrize("arch", ARCHS)
def test_saved_sequence_continues_exactly(arch: str, src_unified: bool, dst_unified: bool) -> None:
    src = context(arch, src_unified)
    decode(src, PROMPT[:16], 0, seq=0)
    decode(src, PROMPT[:5], 0, seq=1)  # another sequence around when saving
    blob = src.state_seq_get_data(0)
    ref = context(arch, dst_unified)  # the continuation computed without a save, in the target mode
    decode(ref, PROMPT[:16], 0, seq=1)
    want = decode(ref, PROMPT[16:20], 16, seq=1)
    # an empty memory, so the loaded cells sit where the reference's are (the same layout sums
    # attention in the same order; the load itself must change nothing)
    dst = context(arch, dst_unified)
    dst.state_seq_set_data(blob, 1)
    assert (dst.memory.seq_pos_min(1), dst.memory.seq_pos_max(1)) == (15, 15)
    got = decode(dst, PROMPT[16:20], 16, seq=1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_whole_context_round_trip(arch: str, unified: bool) -> None:
    ctx = context(arch, unified)
    decode(ctx, PROMPT[:7], 0, seq=1)
    decode(ctx, PROMPT[:12], 0, seq=0)
    blob = ctx.state_get_data()
    want = decode(ctx, PROMPT[12:15], 12, seq=0)
    other = context(arch, unified)
    decode(other, PROMPT[3:9], 0, seq=0)
    other.state_set_data(blob)
    assert torch.equal(decode(other, PROMPT[12:15], 12, seq=0), want)


def rewrite(data: bytes, name: str, t: torch.Tensor) -> bytes:
    """A valid container (checksum and all) with tensor `name` replaced by `t`."""
    state, raw = read_container(data)
    tensors = {n: r.torch() if r.dtype in ("F32", "F16", "BF16", "U8") else r.numpy() for n, r in raw.items()}
    tensors[name] = t
    return write_container(state, tensors)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("bad", ["memory.recurrent.conv.0", "memory.attn.k.1"])
def test_a_corrupted_part_loads_nothing(unified: bool, bad: str) -> None:
    src = context("lfm2", unified)
    decode(src, PROMPT[:10], 0)
    blob = src.state_seq_get_data(0)
    _, raw = read_container(blob)
    wrong = torch.zeros(*raw[bad].shape[:-1], raw[bad].shape[-1] + 1)  # one column too many
    data = rewrite(blob, bad, wrong)
    live = context("lfm2", unified)
    decode(live, PROMPT[4:9], 0, seq=0)
    decode(live, PROMPT[2:5], 0, seq=1)
    assert isinstance(live.memory, HybridMemory)
    before = snapshot(live.memory)
    with pytest.raises(kvtool.StateError):
        live.state_seq_set_data(data, 1)
    assert same(before, snapshot(live.memory))
    live.state_seq_set_data(blob, 1)  # the intact file loads into both parts
    assert live.memory.recurrent.seq_pos_max(1) == 9 and live.memory.attn.seq_pos_max(1) == 9


class WindowedSpec:
    """The lfm2 model's hybrid spec with layer 1 on a sliding window of n_swa."""

    def __init__(self, inner: Any, n_swa: int) -> None:
        self.inner = dataclasses.replace(
            inner, attn=dataclasses.replace(inner.attn, swa_layers=frozenset({1}), swa=SWAParams(n_swa))
        )

    def build(self, params: MemoryParams) -> HybridMemory:
        return self.inner.build(params)

    def memory_breakdown(self, params: MemoryParams) -> MemoryBreakdown:
        return self.inner.memory_breakdown(params)


@pytest.mark.parametrize("unified", [True, False])
def test_a_sliding_window_pair_as_the_attention_part(monkeypatch: pytest.MonkeyPatch, unified: bool) -> None:
    plain = context("lfm2", unified)
    want = decode(plain, PROMPT[:20], 0)
    m = model("lfm2")
    spec = m.memory_spec()
    monkeypatch.setattr(m, "memory_spec", lambda: WindowedSpec(spec, 4))
    narrow = context("lfm2", unified)
    assert isinstance(narrow.memory.attn, SWAKVPart)
    assert not torch.allclose(decode(narrow, PROMPT[:20], 0), want)  # the window changes layer 1
    monkeypatch.setattr(m, "memory_spec", lambda: WindowedSpec(spec, 64))
    wide = context("lfm2", unified)
    assert torch.equal(decode(wide, PROMPT[:20], 0), want)  # wider than the prompt: no change
    before = snapshot_swa(wide.memory)
    assert wide.memory.seq_rm(0, 10, -1) is False
    assert same(before, snapshot_swa(wide.memory))
    blob = wide.state_seq_get_data(0)
    wide.memory.clear(True)
    wide.state_seq_set_data(blob, 1)
    assert (wide.memory.seq_pos_min(1), wide.memory.seq_pos_max(1)) == (19, 19)


def snapshot_swa(mem: HybridMemory) -> list[Any]:
    out: list[Any] = []
    for kv in mem.attn.parts.values():  # type: ignore[attr-defined]
        out += [c.pos.copy() for c in kv.cells] + [t.clone() for t in (*kv.k.values(), *kv.v.values())]
    rs = mem.recurrent
    assert isinstance(rs, RecurrentMemory)
    return out + [rs.cells.pos.copy()] + [t.clone() for ts in rs.states.t.values() for t in ts.values()]
