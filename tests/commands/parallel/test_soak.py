"""The soak (benchmarks/soak.py) in short: the parallel simulation with random seq_rm/seq_cp
between steps must end every round with every cell free, fail no operation, and not grow.
The full run (32 clients, 10 minutes) is the script's; its figures are in docs/reliability.md."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvtool
from benchmarks.soak import Sample, SoakParams, SoakReport, end_round, main, soak

OPS = {
    "seq_rm all",
    "seq_rm head",
    "seq_cp all",
    "seq_cp part",
    "seq_rm all (scratch)",
    "seq_rm tail (scratch)",
}


def test_ten_seconds_of_chaos_keep_every_cell_and_memory_flat(tiny_llama_path: Path) -> None:
    p = SoakParams(
        seconds=10,
        n_clients=8,
        n_ctx=2048,
        sample_every=0.5,
        rss_slack_mb=64,
        model=tiny_llama_path,
        threads=1,
    )
    r = soak(p)
    assert r.errors == []
    assert r.leaks == []
    assert r.n_rounds >= 1 and r.n_requests == 4 * p.n_clients * r.n_rounds
    assert set(r.ops) == OPS  # every kind of operation ran (the first round alone is seeded)
    growth = r.rss_growth_mb()
    assert growth is not None and growth <= 64
    assert r.samples[-1].cells == 0
    assert r.ok


def test_the_script_in_split_mode_says_ok(tiny_llama_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--seconds", "10", "-np", "8", "-c", "2048", "--every", "0.5", "--rss-slack", "64", "-t", "1"]
    assert main([*argv, "--split", "-m", str(tiny_llama_path)]) == 0
    out = capsys.readouterr().out
    assert "kv_unified = 0" in out
    assert out.rstrip().endswith("verdict: rss ok, cells ok, errors ok")


def test_a_run_too_short_to_judge_fails(tiny_llama_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--seconds", "0.1", "-np", "2", "-c", "1024", "-t", "1", "-m", str(tiny_llama_path)]) == 1
    out = capsys.readouterr().out
    assert "(too few samples)" in out and "rss FAILED, cells ok, errors ok" in out


def report_with(anon: list[float], slack: float) -> SoakReport:
    r = SoakReport(SoakParams(seconds=len(anon), warmup=2, rss_slack_mb=slack))
    r.samples = [Sample(float(t), 0.0, a, 0, 0, 0.0, 0) for t, a in enumerate(anon)]
    r.n_rounds = 1
    return r


def test_growth_is_the_later_half_median_minus_the_earlier_half_median() -> None:
    # t = 0, 1 are warm-up; after it: t 2..5 (first half) and 6..9 (second half)
    anon = [50.0, 180.0, 100.0, 103.0, 101.0, 100.0, 104.0, 102.0, 106.0, 103.0]
    assert report_with(anon, 4).rss_growth_mb() == pytest.approx(103.5 - 100.5)
    assert report_with(anon, 4).ok
    assert not report_with(anon, 2).ok
    assert report_with(anon[:5], 4).rss_growth_mb() is None  # three samples after warm-up


def test_one_transient_peak_is_not_growth() -> None:
    anon = [50.0, 180.0, 100.0, 103.0, 101.0, 100.0, 100.0, 130.0, 101.0, 100.0]
    r = report_with(anon, 4)
    assert r.rss_growth_mb() == pytest.approx(0.0)
    assert r.rss_growth_mb(max) == pytest.approx(27.0)
    assert r.ok


@pytest.mark.parametrize(("n_tokens", "leak"), [(3, False), (5, True)])
def test_a_round_that_leaves_more_than_the_system_prompt_is_a_leak(
    tiny_llama: kvtool.Model, n_tokens: int, leak: bool
) -> None:
    ctx = kvtool.Context(tiny_llama, kvtool.ContextParams(n_ctx=256, n_seq_max=4, kv_unified=True))
    r = SoakReport(SoakParams(n_clients=2, n_scratch=1))
    kvtool.decode_tokens(ctx, [5, 6, 7], 0, 0)
    ctx.memory.seq_cp(0, 2, -1, -1)
    kvtool.decode_tokens(ctx, [5, 6, 7, 8, 9][:n_tokens], 1, 0)
    end_round(ctx, r, n_sys=3)
    assert bool(r.leaks) == leak
    assert ctx.n_used_cells() == 0  # the round's end frees every sequence either way
