"""A context's memory is estimated before it is allocated (issue 14, defect 4): the estimate
matches the tensors a context really allocates, a context that cannot fit is refused in one
line before any allocation (`run -c 1000000` was killed by the kernel, `-c 2**31` ended in an
allocation traceback), and a context beyond the training context warns, as llama.cpp does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvtool
import kvtool.memory_estimate as me
from kvtool.batch import Split, UBatch
from kvtool.memory.base import Commit, PartBatches, SeqOp, SeqOps
from kvtool.memory.composite import Composite
from kvtool.memory.sizes import MemoryBreakdown, PartSize
from kvtool.memory.spec import KVSpec, MemoryParams

MODELS = Path(__file__).parent.parent / "data" / "tiny" / "models"
KVTOOL = [sys.executable, "-m", "kvtool.commands"]


def _tensor_bytes(obj: object, seen: set[object] | None = None) -> int:
    """Bytes of every distinct torch storage reachable from `obj`'s attributes: what the memory
    really allocated (the independent measure the estimate is checked against)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):  # views of one storage (the cache's row views) count once
        key = ("storage", obj.untyped_storage().data_ptr())
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("kvtool.memory"):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


ARCHS = ["llama", "gemma3", "mamba", "mamba2", "rwkv6", "rwkv7", "granitehybrid", "lfm2"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("unified", [False, True])
def test_estimate_matches_what_the_context_allocates(arch: str, unified: bool) -> None:
    model = kvtool.Model(MODELS / f"tiny-{arch}.gguf")
    p = kvtool.ContextParams(n_ctx=1024, n_seq_max=2, kv_unified=unified, type_k="f16", n_rs_seq=2)
    ctx = kvtool.Context(model, p)
    est = ctx.memory_estimate
    held = ctx.memory_breakdown()
    got = _tensor_bytes(ctx.memory)
    cells = sum(b.cells for b in held.kv)  # the cells' bookkeeping: numpy, not tensors
    assert got > 0
    assert held.total - cells == got
    assert (est.kv, est.states) == (held.kv_bytes, held.states)


@pytest.mark.parametrize(("type_k", "type_v"), [("q8_0", "q4_0"), ("iq4_nl", "f32"), ("bf16", "q5_1")])
def test_estimate_uses_the_cache_types(type_k: str, type_v: str) -> None:
    """K and V take their types' bytes: 34 per 32 values for q8_0, 18 for q4_0, ..."""
    model = kvtool.Model(MODELS / "tiny-gemma3.gguf")  # head size 32: every type fits
    p = kvtool.ContextParams(n_ctx=512, n_seq_max=2, type_k=type_k, type_v=type_v)
    ctx = kvtool.Context(model, p)
    held = ctx.memory_breakdown()
    assert _tensor_bytes(ctx.memory) == held.total - sum(b.cells for b in held.kv)
    per = {"f32": 128, "bf16": 64, "q8_0": 34, "q4_0": 18, "q5_1": 24, "iq4_nl": 18}  # bytes per 32 values
    hp = model.hparams
    for b in held.kv:
        rows = b.n_stream * b.n_cells * b.n_layer * hp.n_head_kv[0]
        assert b.k == rows * hp.head_dim_k // 32 * per[type_k]
        assert b.v == rows * hp.head_dim_v // 32 * per[type_v]
        assert (b.type_k, b.type_v) == (type_k, type_v)
    assert ctx.memory_estimate.kv == held.kv_bytes


def test_a_block_that_does_not_tile_a_head_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama.cpp's words, before any tensor exists (tiny llama's heads are 16 values)."""
    model = kvtool.Model(MODELS / "tiny-llama.gguf")
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated"))
    with pytest.raises(
        kvtool.KvtoolError, match="K cache type q8_0 with block size 32 does not divide n_embd_head_k=16"
    ):
        kvtool.Context(model, kvtool.ContextParams(n_ctx=256, type_k="q8_0", type_v="f16"))
    with pytest.raises(kvtool.KvtoolError, match=r"V cache type iq4_nl .* n_embd_head_v=16"):
        kvtool.Context(model, kvtool.ContextParams(n_ctx=256, type_v="iq4_nl"))
    with pytest.raises(kvtool.KvtoolError, match=r"unsupported KV cache type 'q3_k' \(f32, f16, bf16, q8_0"):
        kvtool.Context(model, kvtool.ContextParams(n_ctx=256, type_k="q3_k"))


# -- a memory kind the estimate has never seen: its own sizes count, no edit elsewhere ------------
class Ledger(SeqOps, PartBatches):
    """A toy memory part without layers that holds `n_bytes` per sequence (a numpy ledger)."""

    kind = "ledger"
    layers: frozenset[int] = frozenset()
    split = Split.SIMPLE

    def __init__(self, n_seq_max: int, n_bytes: int) -> None:
        self.book = np.zeros((n_seq_max, n_bytes), dtype=np.uint8)

    def plan(self, op: SeqOp) -> Commit:
        return lambda: None

    def memory_breakdown(self) -> MemoryBreakdown:
        n_seq = len(self.book)
        return MemoryBreakdown((PartSize("", "ledger", n_seq, 1, (0,), 0, states=self.book.nbytes),))

    def prepare(self, ubatches: list[UBatch]) -> object:
        return ubatches

    def context(self, ubatches: list[UBatch], plan: object) -> Any:
        raise NotImplementedError  # never decoded here


class LedgerSpec:
    """The model's own KV layers beside a ledger."""

    def __init__(self, inner: KVSpec, n_bytes: int) -> None:
        self.inner, self.n_bytes = inner, n_bytes

    def build(self, params: MemoryParams) -> Composite:
        return Composite({"kv": self.inner.build(params), "ledger": Ledger(params.n_seq_max, self.n_bytes)})

    def memory_breakdown(self, params: MemoryParams) -> MemoryBreakdown:
        n_seq = params.n_seq_max
        ledger = PartSize("", "ledger", n_seq, 1, (0,), 0, states=n_seq * self.n_bytes)
        return self.inner.memory_breakdown(params).named("kv") + MemoryBreakdown((ledger,)).named("ledger")


def test_a_new_memory_kind_gets_its_estimate_from_its_own_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    model = kvtool.Model(MODELS / "tiny-llama.gguf")
    kv_only = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_seq_max=4)).memory_estimate
    inner = model.memory_spec()
    monkeypatch.setattr(model, "memory_spec", lambda: LedgerSpec(inner, 3 << 20))
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_seq_max=4))
    assert ctx.memory_estimate.states == ctx.memory_breakdown().states == 4 * (3 << 20)
    assert ctx.memory_estimate.kv == kv_only.kv and kv_only.states == 0
    assert ctx.memory_breakdown() == ctx.memory_breakdown_of(model, ctx.params)  # the spec says it before
    # the ledger's bytes take part in the "does not fit" check
    monkeypatch.setattr(me, "available_memory", lambda device="cpu": ctx.memory_estimate.total - (6 << 20))
    with pytest.raises(kvtool.KvtoolError, match=r"states 12\.0 MiB"):
        kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_seq_max=4))


def test_a_context_that_cannot_fit_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    model = kvtool.Model(MODELS / "tiny-llama.gguf")
    monkeypatch.setattr(me, "available_memory", lambda device="cpu": 64 << 20)
    kvtool.Context(model, kvtool.ContextParams(n_ctx=4096))  # fits: ~6 MiB of K/V
    with pytest.raises(kvtool.KvtoolError, match=r"context of 262144 tokens needs about .* MiB .* lower -c"):
        kvtool.Context(model, kvtool.ContextParams(n_ctx=1 << 18))


def test_recurrent_state_counts_per_sequence_not_per_cell() -> None:
    """A recurrent model's memory does not grow with n_ctx (its states are per sequence)."""
    model = kvtool.Model(MODELS / "tiny-mamba.gguf")
    small = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_ubatch=8)).memory_estimate
    large = kvtool.Context(model, kvtool.ContextParams(n_ctx=1 << 20, n_ubatch=8)).memory_estimate
    assert small.kv == large.kv == 0 and small.states == large.states > 0


def test_beyond_the_training_context_warns() -> None:
    model = kvtool.Model(MODELS / "tiny-llama.gguf")  # context_length 4096
    with pytest.warns(UserWarning, match=r"n_ctx_seq \(8192\) > n_ctx_train \(4096\)"):
        kvtool.Context(model, kvtool.ContextParams(n_ctx=8192))


@pytest.mark.parametrize(
    "args",
    [
        ["run", "-c", str(2**31), "-p", "hi", "-n", "1", "--no-chat"],
        ["run", "-c", "1000000000", "-p", "hi", "-n", "1", "--no-chat"],
        ["bench", "-p", str(2**31 - 1), "-n", "0", "-r", "1"],  # -p's largest (a C int)
    ],
    ids=["run-c-2**31", "run-c-1e9", "bench-p-2**31-1"],
)
def test_cli_refuses_a_context_that_cannot_fit_in_one_line(args: list[str]) -> None:
    model = str(MODELS / "tiny-llama.gguf")
    r = subprocess.run([*KVTOOL, *args, "-m", model], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "lower -c/--ctx-size" in errors[0], r.stderr
