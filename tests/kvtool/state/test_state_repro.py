"""llama.cpp's save-load-state check: after a load, the next tokens (greedy, and sampled with the
same seed) are those of a run that never saved. For every memory kind (KVCache, SWAKVCache),
both KV modes, whole-context and per-sequence states."""

from __future__ import annotations

import pytest
import torch

import kvtool
from kvtool import Batch, Sampler, SamplerParams


def step(
    ctx: kvtool.Context, sampler: Sampler, logits: torch.Tensor, pos: int, n: int, seq: int = 0
) -> tuple[list[int], torch.Tensor, int]:
    """Samples n tokens, decoding each one: (tokens, the logits after the last, next position)."""
    out = []
    for _ in range(n):
        t = sampler.sample(logits)
        sampler.accept(t)
        out.append(t)
        ctx.decode(Batch.from_tokens([t], seq_id=seq, pos0=pos))
        pos += 1
        logits = ctx.logits_ith(-1)
    return out, logits, pos


@pytest.mark.parametrize("temp", [0.0, 0.9], ids=["greedy", "sampled"])
@pytest.mark.parametrize("scope", ["context", "sequence"])
@pytest.mark.parametrize("unified", [True, False], ids=["kvu1", "kvu0"])
def test_next_tokens_equal_a_run_that_never_saved(model, ctx_of, tokens, unified, scope, temp) -> None:  # type: ignore[no-untyped-def]
    ids = tokens(model, 20)  # longer than gemma3's window of 8
    params = SamplerParams(seed=1234, temp=temp)

    a = ctx_of(model, unified)
    want, want_logits, _ = step(a, Sampler(params), kvtool.decode_tokens(a, ids, 0, 0), len(ids), 10)

    b = ctx_of(model, unified)
    logits = kvtool.decode_tokens(b, ids, 0, 0)
    c = ctx_of(model, unified)
    if scope == "context":
        c.state_set_data(b.state_get_data(tokens={0: ids}))
        seq, logits = 0, c.logits_ith(-1)  # a context state carries the logits
    else:
        c.state_seq_set_data(b.state_seq_get_data(0, tokens=ids), 2)
        seq = 2  # restored into another sequence id
    del b
    got, got_logits, _ = step(c, Sampler(params), logits, len(ids), 10, seq)
    assert got == want
    if scope == "context" or model.arch == "llama":  # the same cells again: bitwise
        assert torch.equal(got_logits, want_logits)
    else:  # a window cache's sequence state drops unseen cells: the next token lands elsewhere
        torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("unified", [True, False], ids=["kvu1", "kvu0"])
def test_sampler_state_continues_mid_generation(model, ctx_of, tokens, unified) -> None:  # type: ignore[no-untyped-def]
    ids = tokens(model, 12, seed=3)
    params = SamplerParams(seed=77, temp=1.0, repeat_penalty=1.3, top_k=0, top_p=1.0, min_p=0.0)
    a = ctx_of(model, unified)
    want, _, _ = step(a, Sampler(params), kvtool.decode_tokens(a, ids, 0, 0), len(ids), 12)

    b = ctx_of(model, unified)
    sampler = Sampler(params)
    first, _, _ = step(b, sampler, kvtool.decode_tokens(b, ids, 0, 0), len(ids), 5)
    data = b.state_get_data(sampler=sampler)

    c = ctx_of(model, unified)
    info = c.state_set_data(data)
    other = Sampler(SamplerParams(**{**params.__dict__, "seed": 5}))  # restored, so the seed does not matter
    assert info.restore_sampler(other) and other.seed == 77
    rest, _, _ = step(c, other, c.logits_ith(-1), len(ids) + 5, 7)
    assert first + rest == want
