"""Traces record removals and copies of ranges (the recorder raised ValueError on a partial
seq_rm, a traceback out of `kvtool parallel --trace`), and defrag-sim replays them: its cells
in use after every step are the engine's."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvtool
from kvtool import Batch, ContextParams
from kvtool.commands.defrag_sim.policies import Policy
from kvtool.commands.defrag_sim.simulator import Geometry, simulate
from kvtool.commands.defrag_sim.trace import TraceRecorder, read_trace
from kvtool.commands.defrag_sim.workload import Copy, Decode, Free, Run


@pytest.mark.parametrize("unified", [True, False])
def test_partial_removals_are_recorded_and_replayed(
    tiny_llama: kvtool.Model, tmp_path: Path, unified: bool
) -> None:
    ctx = kvtool.Context(tiny_llama, ContextParams(n_ctx=512, n_seq_max=2, kv_unified=unified))
    path = tmp_path / "t.jsonl"
    used = []
    with TraceRecorder(path, ctx) as rec:  # the trace is written when the block ends
        traced = rec.wrap(ctx)
        traced.decode(Batch.from_tokens(list(range(3, 13)), 0, 0))
        used.append(ctx.n_used_cells())
        traced.memory.seq_cp(0, 1, -1, -1)
        assert traced.memory.seq_rm(0, 6, -1)  # the tail of 0
        assert traced.memory.seq_rm(1, 2, 4)  # a middle of 1
        traced.decode(Batch.from_tokens([5], 0, 6))
        used.append(ctx.n_used_cells())
        assert traced.memory.seq_rm(-1, 8, -1)  # every sequence
        traced.decode(Batch.from_tokens([6], 1, 8))
        used.append(ctx.n_used_cells())

    w, _ = read_trace(path)
    assert w.ops == (
        Decode(0, ((0, 10),)),
        Copy(1, 0, 1),
        Free(1, 0, 6, -1),
        Free(1, 1, 2, 4),
        Run(1, (0,), 1),
        Free(2, 0, 8, -1),
        Free(2, 1, 8, -1),
        Run(2, (1,), 1),
    )
    r = simulate(w, Policy("non-contiguous"), Geometry(ctx.n_ctx, 2, unified))
    assert r.used.tolist() == used == ([10, 11, 10] if unified else [10, 15, 14])


def test_whole_removals_keep_the_short_form(tiny_llama: kvtool.Model, tmp_path: Path) -> None:
    ctx = kvtool.Context(tiny_llama, ContextParams(n_ctx=256, n_seq_max=1))
    path = tmp_path / "t.jsonl"
    with TraceRecorder(path, ctx) as rec:
        traced = rec.wrap(ctx)
        traced.decode(Batch.from_tokens([3, 4], 0, 0))
        traced.memory.seq_rm(0, 0, -1)
    last = path.read_text().splitlines()[-1]
    assert last == '{"step":1,"event":"free","seq":0,"stream":0}'
