"""The memory contract: composites are all or nothing, K and V types are separate, compute
failures are reported, and a new memory kind plugs in (decode, seq ops, state files) without an
edit in the context or the state code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvtool
from kvtool.batch import Split, UBatch
from kvtool.memory.base import (
    Clear,
    Commit,
    MemoryRefused,
    MemoryStatus,
    NoUpdate,
    PartBatches,
    SeqAdd,
    SeqCp,
    SeqDiv,
    SeqKeep,
    SeqOp,
    SeqOps,
    SeqRm,
)
from kvtool.memory.composite import Composite
from kvtool.memory.sizes import MemoryBreakdown, PartSize
from kvtool.memory.spec import KVSpec, MemoryParams
from kvtool.state import inspect
from kvtool.state.io import StateReader, StateWriter
from tests.helpers.tiny_gemma3 import write_tiny_gemma3


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> kvtool.Model:
    return kvtool.Model(write_tiny_gemma3(tmp_path_factory.mktemp("m") / "g.gguf"))


def snapshot(memory: Any) -> list[Any]:
    """Every cell and tensor of every KV part."""
    parts = list(memory.parts.values()) if isinstance(memory, Composite) else [memory]
    out: list[Any] = []
    for cache in parts:
        for c in cache.cells:
            out += [c.pos.copy(), c.seq.copy(), c.shift.copy(), c.head, c.has_shift]
        out += [t.clone() for t in (*cache.k.values(), *cache.v.values())]
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        if isinstance(x, np.ndarray):
            return np.array_equal(x, y)
        return bool(x == y)

    return len(a) == len(b) and all(eq(x, y) for x, y in zip(a, b, strict=True))


def decode(ctx: kvtool.Context, n: int, seq: int, pos0: int = 0) -> None:
    for i in range(0, n, ctx.n_batch):
        toks = [3 + (7 * (pos0 + j) + seq) % 260 for j in range(i, min(n, i + ctx.n_batch))]
        ctx.decode(kvtool.Batch.from_tokens(toks, seq_id=seq, pos0=pos0 + i, logits="last"))


def test_swa_seq_cp_without_room_in_the_window_changes_nothing(gemma: kvtool.Model) -> None:
    """The review's case: the base cache has room for a partial copy, the window cache does not.
    Planning on both parts first refuses before the base cache changes."""
    ctx = kvtool.Context(gemma, kvtool.ContextParams(n_ctx=1024, n_ubatch=16, n_seq_max=2, swa_full=False))
    mem = ctx.memory
    assert mem.swa.n_cells == 256 and mem.base.n_cells == 512
    decode(ctx, 300, seq=0)  # base: positions 0..299
    decode(ctx, 240, seq=1)  # window stream of seq 1: 240 of 256 cells in use
    before = snapshot(mem)
    with pytest.raises(MemoryRefused, match="no room"):
        mem.seq_cp(0, 1, 240, 300)
    assert same(before, snapshot(mem))
    assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (0, 239)


OPS: list[SeqOp] = [
    Clear(True),
    SeqRm(0, 2, -1),
    SeqCp(0, 1, -1, -1),
    SeqKeep(0),
    SeqAdd(0, 3, -1, 2),
    SeqDiv(0, 3, -1, 2),
]


def _run(mem: Any, op: SeqOp) -> None:
    if isinstance(op, SeqRm):
        assert mem.seq_rm(op.seq_id, op.p0, op.p1) is False
        return
    with pytest.raises(MemoryRefused):
        if isinstance(op, Clear):
            mem.clear(op.data)
        elif isinstance(op, SeqCp):
            mem.seq_cp(op.src, op.dst, op.p0, op.p1)
        elif isinstance(op, SeqKeep):
            mem.seq_keep(op.seq_id)
        elif isinstance(op, SeqAdd):
            mem.seq_add(op.seq_id, op.p0, op.p1, op.delta)
        else:
            mem.seq_div(op.seq_id, op.p0, op.p1, op.d)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("part", ["base", "swa"])
@pytest.mark.parametrize("op", OPS, ids=lambda o: type(o).__name__)
def test_a_part_refusing_any_op_leaves_every_part_unchanged(
    gemma: kvtool.Model, monkeypatch: pytest.MonkeyPatch, unified: bool, part: str, op: SeqOp
) -> None:
    ctx = kvtool.Context(
        gemma, kvtool.ContextParams(n_ctx=512, n_seq_max=2, kv_unified=unified, swa_full=True)
    )
    decode(ctx, 12, seq=0)
    decode(ctx, 5, seq=1)
    mem = ctx.memory
    before = snapshot(mem)

    def refuse(op: SeqOp) -> Commit:
        raise MemoryRefused("injected")

    # The other part plans (and would change) normally: only planning first keeps it intact.
    monkeypatch.setattr(mem.parts[part], "plan", refuse)
    _run(mem, op)
    assert same(before, snapshot(mem))


@pytest.mark.parametrize("unified", [True, False])
def test_k_and_v_types_are_separate(gemma: kvtool.Model, unified: bool) -> None:
    p = kvtool.ContextParams(n_ctx=512, n_seq_max=2, kv_unified=unified, type_k="f16", type_v="bf16")
    ctx = kvtool.Context(gemma, p)
    for cache in ctx.memory.parts.values():
        assert {t.dtype for t in cache.k.values()} == {torch.float16}
        assert {t.dtype for t in cache.v.values()} == {torch.bfloat16}
    decode(ctx, 10, seq=0)
    ref = kvtool.Context(
        gemma, kvtool.ContextParams(n_ctx=512, n_seq_max=2, kv_unified=unified, type_k="f32", type_v="f32")
    )
    decode(ref, 10, seq=0)
    # the cache is read in its own type: close to the f32 cache, not equal to it
    torch.testing.assert_close(ctx.logits(), ref.logits(), atol=0.1, rtol=0.05)
    assert not torch.equal(ctx.logits(), ref.logits())
    layout = inspect(ctx.state_get_data()).memory
    assert layout["parts"]["swa"]["type_k"] == "F16" and layout["parts"]["swa"]["type_v"] == "BF16"


def test_out_of_memory_during_compute_is_status_minus_3_and_rolls_back(
    tiny_llama: kvtool.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256, kv_unified=True))
    decode(ctx, 4, seq=0)

    def oom(*a: Any, **k: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(ctx.model, "forward", oom)
    with pytest.raises(kvtool.DecodeError) as e:
        ctx.decode(kvtool.Batch.from_tokens([5, 6], pos0=4))
    assert e.value.status == -3
    assert ctx.memory.seq_pos_max(0) == 3 and ctx.n_used_cells() == 4


# -- a memory kind the engine has never seen -------------------------------------------------
class TokenCounter(SeqOps, PartBatches):
    """A toy part with no layers: counts the tokens each sequence holds. Enough of the contract
    to ride beside a KV cache through decodes, seq ops and state files."""

    kind = "token_counter"
    layers: frozenset[int] = frozenset()
    split = Split.SIMPLE

    def __init__(self, n_seq_max: int) -> None:
        self.count = np.zeros(n_seq_max, dtype=np.int64)

    def plan(self, op: SeqOp) -> Commit:
        def set_to(values: np.ndarray) -> Commit:
            return lambda: self.count.__setitem__(slice(None), values)

        c = self.count.copy()
        if isinstance(op, Clear):
            c[:] = 0
        elif isinstance(op, SeqRm) and op.p0 < 0 and op.p1 < 0:
            c[op.seq_id if op.seq_id >= 0 else slice(None)] = 0
        elif isinstance(op, SeqRm):
            raise MemoryRefused("a counter cannot forget part of a sequence")
        elif isinstance(op, SeqCp):
            c[op.dst] = c[op.src]
        elif isinstance(op, SeqKeep):
            c[np.arange(len(c)) != op.seq_id] = 0
        return set_to(c)

    def seq_pos_min(self, seq_id: int) -> int:
        return 0 if self.count[seq_id] else -1

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self.count[seq_id]) - 1

    def seq_can_resume(self, seq_id: int, pos: int) -> bool:
        return pos in (0, int(self.count[seq_id]))

    def can_shift(self) -> bool:
        return True

    def n_used(self) -> int:
        return int(np.count_nonzero(self.count))

    def init_update(self, optimize: bool = False) -> NoUpdate:
        return NoUpdate()

    def memory_breakdown(self) -> MemoryBreakdown:
        part = PartSize("", "counter", len(self.count), 1, (self.n_used(),), 0, states=self.count.nbytes)
        return MemoryBreakdown((part,))

    def prepare(self, ubatches: list[UBatch]) -> object:
        return ubatches

    def context(self, ubatches: list[UBatch], plan: object) -> Any:
        counter = self
        before = self.count.copy()

        class Ctx:
            status = MemoryStatus.SUCCESS
            i = 0

            def rollback(self) -> None:
                counter.count[:] = before

            @property
            def ubatch(self) -> UBatch:
                return ubatches[self.i]

            def next(self) -> bool:
                self.i += 1
                return self.i < len(ubatches)

            def apply(self) -> bool:
                for s in ubatches[self.i].seq_id.tolist():
                    counter.count[s] += 1
                return True

            def layer_view(self, il: int) -> Any:
                raise KeyError(il)

        return Ctx()

    def state_write(self, w: StateWriter, seq: int | None) -> None:
        w.layout.update(kind=self.kind, n_seq_max=len(self.count))
        w.put("count", self.count.copy() if seq is None else self.count[seq : seq + 1].copy())

    def state_read(self, r: StateReader, seq: int | None) -> Commit:
        r.expect_kind(self.kind)
        n = len(self.count) if seq is None else 1
        saved = r.take_numpy("count", "I64", (n,))

        def commit() -> None:
            if seq is None:
                self.count[:] = saved
            else:
                self.count[seq] = saved[0]

        return commit


class CountedKV(Composite):
    kind = "counted_kv"


class CountedSpec:
    def __init__(self, inner: KVSpec) -> None:
        self.inner = inner

    def build(self, params: MemoryParams) -> CountedKV:
        return CountedKV({"kv": self.inner.build(params), "count": TokenCounter(params.n_seq_max)})

    def memory_breakdown(self, params: MemoryParams) -> MemoryBreakdown:
        n = params.n_seq_max
        count = MemoryBreakdown((PartSize("", "counter", n, 1, (0,), 0, states=8 * n),))
        return self.inner.memory_breakdown(params).named("kv") + count.named("count")


def test_a_new_memory_kind_plugs_in_without_edits(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = kvtool.Model(tiny_llama_path)
    spec = model.memory_spec()
    monkeypatch.setattr(model, "memory_spec", lambda: CountedSpec(spec))
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_seq_max=2, kv_unified=True))
    assert ctx.memory_breakdown().states == ctx.memory_estimate.states == 16  # its sizes count
    decode(ctx, 6, seq=0)
    ctx.memory.seq_cp(0, 1, -1, -1)
    counter = ctx.memory.parts["count"]
    assert counter.count.tolist() == [6, 6]
    assert ctx.memory.seq_rm(0, 3, -1) is False  # the counter refuses: the KV part is untouched
    assert ctx.memory.seq_pos_max(0) == 5
    logits = ctx.logits().clone()
    saved = ctx.state_get_data()
    ctx.memory.clear(True)
    assert counter.count.tolist() == [0, 0]
    ctx.state_set_data(saved)
    assert counter.count.tolist() == [6, 6] and ctx.memory.seq_pos_max(1) == 5
    torch.testing.assert_close(ctx.logits(), logits, rtol=0, atol=0)
    one = ctx.state_seq_get_data(0)
    ctx.memory.seq_rm(1, -1, -1)
    ctx.state_seq_set_data(one, 1)
    assert counter.count.tolist() == [6, 6]
    plain = kvtool.Context(kvtool.Model(tiny_llama_path), kvtool.ContextParams(n_ctx=256, n_seq_max=2))
    with pytest.raises(kvtool.StateError, match="counted_kv"):
        plain.state_set_data(saved)
