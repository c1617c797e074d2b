"""A decode that fails in a later ubatch leaves every memory kind exactly as it was: cells,
positions and the K/V rows (or recurrent states) a sliding window's earlier ubatch took over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import kvtool
from kvtool.memory.kv_cache import KVCache
from kvtool.memory.recurrent.memory import RecurrentMemory

MODELS = Path(__file__).parent.parent / "data" / "tiny" / "models"


def parts(memory: Any) -> list[Any]:
    if hasattr(memory, "parts"):
        return [q for p in memory.parts.values() for q in parts(p)]
    return [memory]


def snapshot(memory: Any) -> list[Any]:
    """Everything a memory holds, copied: its cells' bookkeeping and its tensors."""
    out: list[Any] = []
    for p in parts(memory):
        if isinstance(p, KVCache):
            for s, c in enumerate(p.cells):
                out += [c.pos.copy(), c.seq.copy(), c.shift.copy(), c.head]
                used = torch.from_numpy(c.pos != c.EMPTY)  # an empty cell's row is never read
                out += [t[s][used].clone() for t in (*p.k.values(), *p.v.values())]
        elif isinstance(p, RecurrentMemory):
            c = p.cells
            out += [c.tail.copy(), c.pos.copy(), c.n_hist.copy()]
            out += [t.clone() for group in p.states.t.values() for t in group.values()]
        else:
            raise AssertionError(f"no snapshot for {type(p).__name__}")
    return out


def same(a: list[Any], b: list[Any]) -> bool:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif hasattr(x, "shape"):
            if not (x == y).all():
                return False
        elif x != y:
            return False
    return True


def fail_on_call(ctx: kvtool.Context, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The model's forward raises at its n-th call (1-based), after the earlier ones ran."""
    forward = ctx.model.forward
    calls = [0]

    def flaky(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return forward(*a, **k)

    monkeypatch.setattr(ctx.model, "forward", flaky)


@pytest.mark.parametrize("arch", ["gemma3", "llama", "mamba2", "granitehybrid", "lfm2", "rwkv7"])
def test_a_batch_failing_in_its_third_ubatch_changes_nothing(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = kvtool.Model(MODELS / f"tiny-{arch}.gguf")
    params = kvtool.ContextParams(n_ctx=1024, n_batch=64, n_ubatch=16, n_seq_max=2)
    ctx = kvtool.Context(model, params)
    prompt = [3 + i % 50 for i in range(240)]
    kvtool.decode_tokens(ctx, prompt, 0, 0)
    kvtool.decode_tokens(ctx, [7, 8, 9], 1, 0)
    before = snapshot(ctx.memory)
    bounds = [(ctx.memory.seq_pos_min(s), ctx.memory.seq_pos_max(s)) for s in (0, 1)]

    fail_on_call(ctx, monkeypatch, 3)
    batch = kvtool.Batch.from_tokens([60 + i % 30 for i in range(64)], seq_id=0, pos0=240)
    with pytest.raises(KeyboardInterrupt):
        ctx.decode(batch)
    monkeypatch.undo()

    assert [(ctx.memory.seq_pos_min(s), ctx.memory.seq_pos_max(s)) for s in (0, 1)] == bounds
    assert same(snapshot(ctx.memory), before)
    # and it goes on as if the batch never was
    got = kvtool.decode_tokens(ctx, [11, 12], 0, 240)
    ref = kvtool.Context(model, params)
    want = kvtool.decode_tokens(ref, [*prompt, 11, 12], 0, 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_window_took_over_cells_the_state_before_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case the rollback exists for: Gemma 3's window cache wraps in the batch's second
    ubatch and reuses cells of positions 0-15; without the undo, seq_pos_min moves to 16."""
    model = kvtool.Model(MODELS / "tiny-gemma3.gguf")
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=1024, n_batch=64, n_ubatch=16))
    swa = ctx.memory.parts["swa"]
    assert swa.n_cells == 256
    kvtool.decode_tokens(ctx, [3 + i % 50 for i in range(240)], 0, 0)
    seen: list[int] = []
    forward = ctx.model.forward

    def watch(*a: Any, **k: Any) -> Any:
        seen.append(swa.seq_pos_min(0))
        if len(seen) == 3:
            raise KeyboardInterrupt
        return forward(*a, **k)

    monkeypatch.setattr(ctx.model, "forward", watch)
    with pytest.raises(KeyboardInterrupt):
        ctx.decode(kvtool.Batch.from_tokens([5] * 64, pos0=240))
    assert seen[1] == 16  # the second ubatch overwrote positions 0-15
    assert swa.seq_pos_min(0) == 0 and ctx.memory.seq_pos_min(0) == 0


def test_out_of_memory_in_the_second_ubatch_of_a_window_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: a compute failure (status -3) in a batch's second ubatch, whose apply
    moved Gemma 3's window past positions 0-15 (test above); the memory is as it was, window
    included, and decoding goes on as if the batch never was."""
    model = kvtool.Model(MODELS / "tiny-gemma3.gguf")
    params = kvtool.ContextParams(n_ctx=1024, n_batch=64, n_ubatch=16)
    ctx = kvtool.Context(model, params)
    prompt = [3 + i % 50 for i in range(240)]
    kvtool.decode_tokens(ctx, prompt, 0, 0)
    before = snapshot(ctx.memory)
    forward, calls = ctx.model.forward, [0]

    def oom_second(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError("injected")
        return forward(*a, **k)

    monkeypatch.setattr(ctx.model, "forward", oom_second)
    with pytest.raises(kvtool.DecodeError) as e:
        ctx.decode(kvtool.Batch.from_tokens([60 + i % 30 for i in range(64)], pos0=240))
    monkeypatch.undo()
    assert e.value.status == -3 and calls[0] == 2
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, 239)
    assert ctx.memory.parts["swa"].seq_pos_min(0) == 0
    assert same(snapshot(ctx.memory), before)
    got = kvtool.decode_tokens(ctx, [11, 12], 0, 240)
    want = kvtool.decode_tokens(kvtool.Context(model, params), [*prompt, 11, 12], 0, 0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
