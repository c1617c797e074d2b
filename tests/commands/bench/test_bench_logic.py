"""llama-bench's logic: test names, the statistics, and the runs'
effect on the memory (depth kept, test tokens dropped between repetitions)."""

from __future__ import annotations

import random
import re
import statistics

import pytest

import kvtool
from kvtool.commands.bench.logic import (
    BenchResult,
    BenchTest,
    bench_tests,
    run_bench_test,
    stdev,
)
from kvtool.common.model_desc import model_desc


def test_test_names_and_order() -> None:
    tests = bench_tests([512, 0], [128], [(256, 32)], 0)
    assert [t.name for t in tests] == ["pp512", "tg128", "pp256+tg32"]
    assert BenchTest(512, 0, 1024).name == "pp512 @ d1024"
    assert BenchTest(0, 128, 512).n_ctx == 640


def test_statistics_match_llama_bench() -> None:
    r = BenchResult(BenchTest(100, 0), [1_000_000_000, 2_000_000_000, 4_000_000_000])
    assert r.samples_ts == [100.0, 50.0, 25.0]
    assert r.avg_ts == pytest.approx(175 / 3)
    assert r.stddev_ts == pytest.approx(statistics.stdev([100.0, 50.0, 25.0]))
    assert r.avg_ns == 7_000_000_000 // 3
    assert stdev([5.0]) == 0.0


@pytest.mark.parametrize("depth", [0, 24])
def test_runs_leave_only_the_depth_between_repetitions(tiny_llama: kvtool.Model, depth: int) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256, n_batch=16, n_seq_max=1))
    seen = []
    test = BenchTest(40, 5, depth)
    r = run_bench_test(ctx, test, 3, random.Random(0), on_phase=lambda name, rep: seen.append((name, rep)))
    assert len(r.samples_ns) == 3 and all(t > 0 for t in r.samples_ns)
    assert seen == [("warmup", 0)] + ([("depth", 0)] if depth else []) + [("run", 1), ("run", 2), ("run", 3)]
    # the last repetition's tokens follow the depth prefix
    assert ctx.memory.seq_pos_max(0) == depth + 40 + 5 - 1
    assert ctx.n_used_cells() == depth + 45


def test_model_desc(tiny_llama: kvtool.Model) -> None:
    assert re.fullmatch(r"llama \d+K F32", model_desc(tiny_llama))
