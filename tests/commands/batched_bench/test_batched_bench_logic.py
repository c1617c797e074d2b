"""batched-bench's accounting: N_KV is what the memory really holds, speeds follow from it,
and combinations that cannot fit (in total or per stream) are skipped."""

from __future__ import annotations

import random

import pytest

import kvtool
from kvtool.commands.batched_bench.logic import batched_n_kv, batched_run, batched_skip_reason, batched_warmup


def make_ctx(model: kvtool.Model, n_ctx: int, n_seq_max: int, kv_unified: bool) -> kvtool.Context:
    return kvtool.Context(
        model, kvtool.ContextParams(n_ctx=n_ctx, n_seq_max=n_seq_max, kv_unified=kv_unified)
    )


@pytest.mark.parametrize("kv_unified", [False, True])
@pytest.mark.parametrize("pps", [False, True])
@pytest.mark.parametrize("tgs", [False, True])
def test_n_kv_is_the_cells_in_use(tiny_llama: kvtool.Model, kv_unified: bool, pps: bool, tgs: bool) -> None:
    ctx = make_ctx(tiny_llama, 2048, 4, kv_unified)
    batched_warmup(ctx, random.Random(0))
    pp, tg, pl = 12, 3, 4
    r = batched_run(ctx, pp, tg, pl, pps, random.Random(0), tg_separate=tgs)
    want = pp + pl * tg if (pps and kv_unified) else pl * (pp + tg)
    assert r.n_kv == batched_n_kv(pp, tg, pl, pps, kv_unified) == want
    assert ctx.n_used_cells() == r.n_kv  # a shared prompt is stored once only in a unified cache
    for s in range(pl):
        assert (ctx.memory.seq_pos_min(s), ctx.memory.seq_pos_max(s)) == (0, pp + tg - 1)
    n_pp = pp if pps else pl * pp
    assert r.t == pytest.approx(r.t_pp + r.t_tg)
    assert r.speed_pp == pytest.approx(n_pp / r.t_pp)
    assert r.speed_tg == pytest.approx(pl * tg / r.t_tg)
    assert r.speed == pytest.approx((n_pp + pl * tg) / r.t)


def test_n_kv_arithmetic() -> None:
    assert batched_n_kv(128, 128, 16, False, False) == 16 * 256
    assert batched_n_kv(128, 128, 16, False, True) == 16 * 256
    assert batched_n_kv(512, 128, 4, True, True) == 512 + 4 * 128
    assert batched_n_kv(512, 128, 4, True, False) == 4 * 512 + 4 * 128


def test_skips_what_does_not_fit(tiny_llama: kvtool.Model) -> None:
    split = make_ctx(tiny_llama, 2048, 4, False)  # 4 streams of 512 cells
    assert batched_skip_reason(split, 500, 12, 4, False) is None
    assert "per sequence" in (batched_skip_reason(split, 600, 10, 1, False) or "")  # one stream is too small
    assert "n_ctx" in (batched_skip_reason(split, 500, 100, 4, False) or "")
    unified = make_ctx(tiny_llama, 2048, 4, True)
    assert batched_skip_reason(unified, 600, 10, 1, False) is None  # the whole buffer is there
    assert batched_skip_reason(unified, 1024, 256, 4, True) is None  # 1024 + 4 * 256 = 2048
    assert batched_skip_reason(unified, 1024, 257, 4, True) is not None
