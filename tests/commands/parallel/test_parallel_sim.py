"""The parallel simulation on the tiny model: every request answered, sequences reused, the
system prompt kept, waves, and the cache-miss halving (llama-parallel's accounting)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

import kvtool
from kvtool.commands.parallel.prompts import QUESTIONS, pick_requests, read_prompts
from kvtool.commands.parallel.sim import ParallelParams, ParallelSim

SYSTEM = "A chat!!\n"
GREEDY = kvtool.SamplerParams(temp=0.0)


def make_ctx(model: kvtool.Model, n_clients: int, n_ctx: int, kv_unified: bool, n_batch: int = 2048):
    params = kvtool.ContextParams(
        n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_clients + 1, kv_unified=kv_unified
    )
    return kvtool.Context(model, params)


def question_of_length(model: kvtool.Model, n_tokens: int) -> str:
    """A question whose prompt text ("User:\\n...\\nAssistant:\\n") is exactly n_tokens long."""
    for k in range(1000):
        q = "Why is the sky blue" + "?" * k
        if len(model.tokenize(f"User:\n{q}\nAssistant:\n", add_special=False)) == n_tokens:
            return q
    raise AssertionError(f"no question of {n_tokens} tokens")


@pytest.mark.parametrize("kv_unified", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_every_request_is_answered_and_sequences_are_reused(
    tiny_llama: kvtool.Model, kv_unified: bool, shared: bool
) -> None:
    ctx = make_ctx(tiny_llama, 3, 2048, kv_unified)
    p = ParallelParams(3, 7, 5, shared_system=shared, system=SYSTEM, sampler=kvtool.SamplerParams(seed=3))
    sim = ParallelSim(ctx, p)
    started = []
    summary = sim.run(on_start=lambda c: started.append((c.id, c.seq)))
    recs = summary.records
    assert sorted(r.seq for r in recs) == list(range(7))
    assert sorted(started) == sorted((r.client, r.seq) for r in recs)
    assert set(Counter(r.client for r in recs).values()) <= {2, 3}  # 7 requests over 3 clients
    for r in recs:
        # the answer stops at n_predict, or earlier (after 3 tokens) at end of generation
        assert 3 <= r.n_decoded <= 5 and (r.stop != "length" or r.n_decoded == 5)
        text = f"User:\n{r.input}\nAssistant:\n"
        want = tiny_llama.tokenize(text if shared else SYSTEM + text, add_special=False)
        assert r.n_prompt == len(want)
        assert r.t_end >= r.t_start
    assert summary.n_prompt == sum(r.n_prompt for r in recs)
    assert summary.n_gen == sum(r.n_decoded for r in recs)
    assert summary.n_cache_miss == 0
    n_sys = len(tiny_llama.tokenize(SYSTEM, add_special=True))
    assert summary.n_system_tokens == n_sys
    # each client's sequence is back to the system prompt only (or empty without -pps)
    for c in range(3):
        assert ctx.memory.seq_pos_max(c + 1) == (n_sys - 1 if shared else -1)
    assert ctx.memory.seq_pos_max(0) == (n_sys - 1 if shared else -1)


def test_waves_start_only_when_the_previous_wave_is_done(tiny_llama: kvtool.Model) -> None:
    ctx = make_ctx(tiny_llama, 2, 1024, True)
    p = ParallelParams(2, 5, 4, cont_batching=False, shared_system=True, system=SYSTEM)
    recs = sorted(ParallelSim(ctx, p).run().records, key=lambda r: r.seq)
    waves = [recs[0:2], recs[2:4], recs[4:5]]
    for prev, nxt in itertools.pairwise(waves):
        assert min(r.t_start for r in nxt) >= max(r.t_end for r in prev)
    assert [r.client for r in recs] == [0, 1, 0, 1, 0]


@pytest.mark.parametrize(("n_batch", "misses_per_wave"), [(2048, 11), (2, 1)])
def test_a_full_cache_halves_the_batch_and_counts_misses(
    tiny_llama: kvtool.Model, n_batch: int, misses_per_wave: int
) -> None:
    """Two clients in lockstep: before their third answer token goes in, the unified cache has
    one free cell. The 2-token step fails; n_batch halves down to 1 (log2(n_batch) misses), the
    first client decodes its token, samples its fourth and last, frees its cells, and the
    second one then fits."""
    ctx = make_ctx(tiny_llama, 2, 256, True, n_batch=n_batch)
    n_sys = len(tiny_llama.tokenize(SYSTEM, add_special=True))
    # cells before the last step: system + 2 * (prompt + 2 answer tokens) = n_ctx - 1
    n_prompt = (ctx.n_ctx - 1 - n_sys - 4) // 2
    assert n_sys + 2 * (n_prompt + 2) == ctx.n_ctx - 1
    q = question_of_length(tiny_llama, n_prompt)
    # n_predict 4: every answer is exactly 4 tokens (stops are only honoured from the third,
    # and the tiny model's answers hold no end of generation there); the fourth is not decoded
    p = ParallelParams(2, 4, 4, shared_system=True, system=SYSTEM, prompts=[q], sampler=GREEDY)
    summary = ParallelSim(ctx, p).run()
    assert summary.n_cache_miss == 2 * misses_per_wave
    assert [r.n_decoded for r in summary.records] == [4, 4, 4, 4]
    assert [r.cache_miss for r in summary.records] == [misses_per_wave] * 2 + [2 * misses_per_wave] * 2


def test_a_single_token_that_does_not_fit_is_fatal(tiny_llama: kvtool.Model) -> None:
    """Two clients in lockstep fill the unified cache to its last cell: halving cannot help,
    n_batch 1 fails."""
    ctx = make_ctx(tiny_llama, 2, 256, True)
    system = next(s for s in (SYSTEM, "A chat!\n") if (ctx.n_ctx - len(tiny_llama.tokenize(s)) - 4) % 2 == 0)
    n_sys = len(tiny_llama.tokenize(system, add_special=True))
    n_prompt = (ctx.n_ctx - n_sys - 4) // 2  # system + 2 * (prompt + 2) = n_ctx
    q = question_of_length(tiny_llama, n_prompt)
    p = ParallelParams(2, 2, 4, shared_system=True, system=system, prompts=[q], sampler=GREEDY)
    with pytest.raises(kvtool.DecodeError, match="n_batch = 1"):
        ParallelSim(ctx, p).run()


def test_a_client_stops_at_the_end_of_its_own_stream(tiny_llama: kvtool.Model) -> None:
    """Split mode: an answer that reaches the end of its client's stream stops there ("length")
    instead of failing, as llama-server's slots do."""
    ctx = make_ctx(tiny_llama, 2, 768, False)
    n_sys = len(tiny_llama.tokenize(SYSTEM, add_special=True))
    q = question_of_length(tiny_llama, ctx.n_ctx_seq - n_sys - 2)  # room for 2 answer tokens
    p = ParallelParams(2, 2, 5, shared_system=True, system=SYSTEM, prompts=[q], sampler=GREEDY)
    recs = ParallelSim(ctx, p).run().records
    assert [(r.n_decoded, r.stop) for r in recs] == [(3, "length")] * 2


def test_context_must_have_a_sequence_per_client(tiny_llama: kvtool.Model) -> None:
    with pytest.raises(ValueError, match="n_seq_max"):
        ParallelSim(make_ctx(tiny_llama, 1, 512, True), ParallelParams(n_clients=2))


def test_requests_are_drawn_reproducibly() -> None:
    a = list(pick_requests(QUESTIONS, 20, 3, 1234))
    assert a == list(pick_requests(QUESTIONS, 20, 3, 1234))
    assert {q for q, _, _ in a} <= set(QUESTIONS)
    assert all(0 <= k < 3 and len(junk) == k for _, k, junk in a)
    assert all(k == 0 for _, k, _ in pick_requests(QUESTIONS, 20, 1, 1234))  # -j 1: no junk
    assert read_prompts("first?\n\n  second? \n") == ["first?", "second?"]


def test_requests_are_drawn_as_the_run_reaches_them() -> None:
    """-ns 10**12 built a list of every request before the first was sent (issue 28, item 5):
    a request is drawn when it is asked for, the same draws in the same order."""
    many = pick_requests(QUESTIONS, 10**12, 10_000, 1234)
    assert len(many) == 10**12
    few = list(pick_requests(QUESTIONS, 5, 10_000, 1234))
    assert [many[i] for i in (0, 1, 2, 3, 4)] == few and many[4] is many[4]
    with pytest.raises(IndexError):
        many[10**12]
