"""Position ops on cached tokens (seq_add, seq_div): after the op, a decode must compute what an
independent decode of the same tokens at their new positions computes, which only holds if every
cached K row was re-rotated by its own position delta, with its own layer's RoPE (NORM for llama,
NEOX with a base per layer kind for gemma3).

The reference is exact in two cases only. (1) A whole-sequence shift on any model: RoPE is
relative, so moving every token by the same delta changes no attention score. (2) Any shift or
division on a 1-layer model: its K/V of a token depend on that token and its position alone, while
in a deeper model a kept token's K/V in later layers still carry the tokens that were discarded.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams
from tests.helpers.tiny_gemma3 import TinyGemma3, write_tiny_gemma3
from tests.helpers.tiny_gguf import TinyLlama, spm_vocab, write_tiny_llama

# gemma3's fp16-table GELU turns f32 summation-order noise into rare fp16 rounding flips
TOL = {"llama": dict(rtol=1e-4, atol=1e-4), "gemma3": dict(rtol=2e-3, atol=2e-3)}

ONE_LAYER = ["llama", "gemma3-swa", "gemma3-global"]
N_VOCAB = len(spm_vocab()[0])  # of every tiny model written here


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads and lose a lot on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_llama: kvtool.Model) -> dict[str, kvtool.Model]:
    """1-layer models of each RoPE kind (llama: NORM, base 1e4; gemma3 sliding layer: NEOX, base
    1e4, window 8; gemma3 global layer: NEOX, base 1e6), and the deeper default tiny models."""
    d = tmp_path_factory.mktemp("shift")
    return {
        "llama": kvtool.Model(write_tiny_llama(d / "llama1.gguf", TinyLlama(n_layer=1, seed=1))),
        "gemma3-swa": kvtool.Model(
            write_tiny_gemma3(d / "g3swa.gguf", TinyGemma3(n_layer=1, swa_pattern=[True]))
        ),
        "gemma3-global": kvtool.Model(
            write_tiny_gemma3(d / "g3global.gguf", TinyGemma3(n_layer=1, swa_pattern=[False]))
        ),
        "llama-deep": tiny_llama,
        "gemma3-deep": kvtool.Model(write_tiny_gemma3(d / "g3.gguf")),
    }


def tol(name: str) -> dict[str, float]:
    return TOL[name.split("-")[0]]


def context(model: kvtool.Model, unified: bool) -> Context:
    """Four sequences; split mode gives each its own 256-cell stream. swa_full keeps the window
    cache as large as the base cache, which a shift needs (llama.cpp's iswa get_can_shift). f32
    caches: a re-rotated row is exact only if it is not rounded again (shifts of the other cache
    types have their own tests, tests/kvtool/test_context_shift_types.py)."""
    n_ctx = 256 if unified else 1024
    params = ContextParams(
        n_ctx=n_ctx, n_seq_max=4, kv_unified=unified, swa_full=True, type_k="f32", type_v="f32"
    )
    return Context(model, params)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, N_VOCAB, size=n).tolist()


def fresh(model: kvtool.Model, prompt: list[int], cont: list[int], pos0: int = 0) -> torch.Tensor:
    """Reference: `prompt` decoded at pos0.. in a new context, then each token of `cont` decoded
    alone; the logits of the `cont` tokens [len(cont), n_vocab]."""
    ctx = context(model, unified=True)
    ctx.decode(Batch.from_tokens(prompt, pos0=pos0))
    rows = []
    for i, t in enumerate(cont):
        ctx.decode(Batch.from_tokens([t], pos0=pos0 + len(prompt) + i))
        rows.append(ctx.logits()[0].clone())
    return torch.stack(rows)


def placed(model: kvtool.Model, cells: list[tuple[int, int]], query: int, qpos: int) -> torch.Tensor:
    """Reference for a 1-layer model: sequence 0 holds each (token, pos) of `cells`, several at one
    position if asked (a batch cannot express that). Each token is decoded alone in sequence 1 at
    its position, then shared into sequence 0 (metadata only in one stream); its K/V depend on
    nothing else. Returns the logits of `query` decoded at `qpos` on sequence 0."""
    ctx = context(model, unified=True)
    for t, p in cells:
        ctx.decode(Batch.from_tokens([t], seq_id=1, pos0=p))
        ctx.memory.seq_cp(1, 0, -1, -1)
        ctx.memory.seq_rm(1, -1, -1)
    ctx.decode(Batch.from_tokens([query], pos0=qpos))
    return ctx.logits()[0].clone()


def decode_each(ctx: Context, seqs: dict[int, list[int]], pos0: dict[int, int]) -> dict[int, torch.Tensor]:
    """Decodes step k of every sequence together, one token each; the rows per sequence."""
    out: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    for k in range(len(next(iter(seqs.values())))):
        b = Batch()
        for s, ts in seqs.items():
            b.add(ts[k], pos0[s] + k, [s], True)
        ctx.decode(b)
        for row, s in enumerate(seqs):
            out[s].append(ctx.logits()[row].clone())
    return {s: torch.stack(r) for s, r in out.items()}


# -- context shift: drop [n_keep, n_keep + n_discard), move the rest down ----------------------
@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("name", ONE_LAYER)
def test_context_shift_equals_fresh_decode(models: dict[str, kvtool.Model], name: str, unified: bool) -> None:
    """llama-cli's context shift on a 1-layer model: the kept tokens, re-rotated, must give what
    the kept tokens decoded afresh at their new positions give, for two decodes in a row (the
    shift is applied once). With a window of 8 the queries see only part of the kept tokens."""
    model = models[name]
    p, cont = tokens(20, seed=1), tokens(2, seed=2)
    n_keep, n_discard = 2, 6
    ctx = context(model, unified)
    ctx.decode(Batch.from_tokens(p))
    assert ctx.memory.seq_rm(0, n_keep, n_keep + n_discard)
    ctx.memory.seq_add(0, n_keep + n_discard, -1, -n_discard)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, 13)
    assert ctx.n_used_cells() == 14
    got = decode_each(ctx, {0: cont}, {0: 14})[0]
    kept = p[:n_keep] + p[n_keep + n_discard :]
    torch.testing.assert_close(got, fresh(model, kept, cont), **tol(name))


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("name", ONE_LAYER)
def test_context_shift_of_one_sequence_among_others(
    models: dict[str, kvtool.Model], name: str, unified: bool
) -> None:
    """Three sequences; sequence 1 is shifted (its own stream in split mode): it must compute what
    its kept tokens compute afresh, and sequences 0 and 2 must not notice."""
    model = models[name]
    ps = [tokens(n, seed=10 + s) for s, n in enumerate([15, 18, 12])]
    conts = {s: tokens(2, seed=20 + s) for s in range(3)}
    ctx = context(model, unified)
    b = Batch()
    for s, p in enumerate(ps):
        for i, t in enumerate(p):
            b.add(t, i, [s], False)
    ctx.decode(b)
    ctx.memory.seq_rm(1, 3, 8)
    ctx.memory.seq_add(1, 8, -1, -5)
    assert [(ctx.memory.seq_pos_min(s), ctx.memory.seq_pos_max(s)) for s in range(3)] == [
        (0, 14),
        (0, 12),
        (0, 11),
    ]
    got = decode_each(ctx, conts, {0: 15, 1: 13, 2: 12})
    t = tol(name)
    torch.testing.assert_close(got[0], fresh(model, ps[0], conts[0]), **t)
    torch.testing.assert_close(got[1], fresh(model, ps[1][:3] + ps[1][8:], conts[1]), **t)
    torch.testing.assert_close(got[2], fresh(model, ps[2], conts[2]), **t)


# -- whole-sequence shift: exact on any depth ---------------------------------------------------
@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize(("pos0", "delta"), [(0, 5), (9, -9)])
@pytest.mark.parametrize("name", ["llama-deep", "gemma3-deep"])
def test_whole_sequence_shift_equals_decode_at_shifted_positions(
    models: dict[str, kvtool.Model], name: str, pos0: int, delta: int, unified: bool
) -> None:
    """RoPE is relative: moving every cached token of a sequence by delta and continuing equals
    decoding the same tokens at pos0 + delta (2-layer llama; 4-layer gemma3 whose sliding and
    global layers rotate with bases 1e4 and 1e6)."""
    model = models[name]
    p, cont = tokens(20, seed=4), tokens(2, seed=5)
    ctx = context(model, unified)
    ctx.decode(Batch.from_tokens(p, seq_id=1, pos0=pos0))  # sequence 1: its own stream in split mode
    ctx.memory.seq_add(1, -1, -1, delta)
    assert (ctx.memory.seq_pos_min(1), ctx.memory.seq_pos_max(1)) == (pos0 + delta, pos0 + delta + 19)
    got = decode_each(ctx, {1: cont}, {1: pos0 + delta + 20})[1]
    torch.testing.assert_close(got, fresh(model, p, cont, pos0=pos0 + delta), **tol(name))


# -- seq_div: positions [8, 20) -> 4, 4, 5, 5, ..., 9, 9 ------------------------------------------
@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("name", ONE_LAYER)
def test_seq_div_equals_tokens_placed_at_divided_positions(
    models: dict[str, kvtool.Model], name: str, unified: bool
) -> None:
    """Self-extend's seq_div on sequence 2 of a 1-layer model: a query then computes what it
    computes over the same tokens placed at the divided positions (two tokens per position from
    4 to 9, and positions 4..7 also hold their original tokens). Sequence 0 must not notice."""
    model = models[name]
    p, other = tokens(20, seed=6), tokens(10, seed=7)
    q2, q0 = tokens(1, seed=8)[0], tokens(1, seed=9)[0]
    ctx = context(model, unified)
    b = Batch()
    for i, t in enumerate(other):
        b.add(t, i, [0], False)
    for i, t in enumerate(p):
        b.add(t, i, [2], False)
    ctx.decode(b)
    ctx.memory.seq_div(2, 8, -1, 2)
    assert (ctx.memory.seq_pos_min(2), ctx.memory.seq_pos_max(2)) == (0, 9)
    assert ctx.memory.seq_pos_max(0) == 9
    got = decode_each(ctx, {2: [q2], 0: [q0]}, {2: 10, 0: 10})
    ref = placed(model, [(t, i if i < 8 else i // 2) for i, t in enumerate(p)], q2, 10)
    t = tol(name)
    torch.testing.assert_close(got[2][0], ref, **t)
    torch.testing.assert_close(got[0], fresh(model, other, [q0]), **t)


# -- a pending shift travels with the cells ------------------------------------------------------
@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("name", ["llama", "gemma3-swa"])
def test_two_pending_shifts_then_a_fork(models: dict[str, kvtool.Model], name: str, unified: bool) -> None:
    """Two context shifts with no decode between them accumulate; the sequence is then forked
    before the shift is applied (split mode copies the cells and their K rows to another stream,
    unified mode shares them). Both branches must compute what the kept tokens compute afresh."""
    model = models[name]
    p = tokens(20, seed=30)
    ctx = context(model, unified)
    ctx.decode(Batch.from_tokens(p))
    ctx.memory.seq_rm(0, 2, 5)
    ctx.memory.seq_add(0, 5, -1, -3)  # p[5:] now at 2..16
    ctx.memory.seq_rm(0, 4, 7)
    ctx.memory.seq_add(0, 7, -1, -3)  # p[10:] now at 4..13
    ctx.memory.seq_cp(0, 1, -1, -1)
    kept = p[:2] + p[5:7] + p[10:]
    conts = {0: tokens(2, seed=31), 1: tokens(2, seed=32)}
    got = decode_each(ctx, conts, {0: 14, 1: 14})
    for s in (0, 1):
        torch.testing.assert_close(got[s], fresh(model, kept, conts[s]), **tol(name))


@pytest.mark.parametrize(("save_unified", "load_unified"), [(True, False), (False, True)])
def test_pending_shift_survives_a_state_round_trip(
    models: dict[str, kvtool.Model], save_unified: bool, load_unified: bool
) -> None:
    """A sequence saved between the shift and the decode that applies it, then loaded into
    another sequence of a context in the other KV mode, computes what the kept tokens compute."""
    model = models["llama"]
    p, cont = tokens(16, seed=33), tokens(2, seed=34)
    ctx = context(model, save_unified)
    ctx.decode(Batch.from_tokens(p))
    ctx.memory.seq_rm(0, 1, 6)
    ctx.memory.seq_add(0, 6, -1, -5)
    blob = ctx.state_seq_get_data(0)
    other = context(model, load_unified)
    other.state_seq_set_data(blob, 3)
    assert (other.memory.seq_pos_min(3), other.memory.seq_pos_max(3)) == (0, 10)
    got = decode_each(other, {3: cont}, {3: 11})[3]
    torch.testing.assert_close(got, fresh(model, p[:1] + p[6:], cont), **tol("llama"))


def test_window_cache_can_shift_only_at_full_size(models: dict[str, kvtool.Model]) -> None:
    """llama.cpp's iswa memory shifts only when its window cache is as large as the base cache
    (--swa-full); a cache without a window always can."""
    model = models["gemma3-deep"]
    assert Context(model, ContextParams(n_ctx=1024, swa_full=True)).memory.can_shift()
    assert not Context(model, ContextParams(n_ctx=1024, swa_full=False)).memory.can_shift()
    assert Context(models["llama-deep"], ContextParams(n_ctx=1024)).memory.can_shift()


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize(("type_kv", "atol"), [("f16", 2e-3), ("bf16", 1e-2)])
@pytest.mark.parametrize("name", ["llama", "gemma3-swa"])
def test_context_shift_on_a_half_precision_cache(
    models: dict[str, kvtool.Model], name: str, type_kv: str, atol: float, unified: bool
) -> None:
    """K stored in f16/bf16 is re-rotated too. Not exact: the shifted K is rounded twice (at its
    old and at its new position), a fresh one once. Measured max |diff|: f16 1.9e-4 (llama),
    7.9e-4 (gemma3); bf16 2.8e-3 and 4.9e-3. A missing re-rotation gives 0.6 and 2.0."""
    model = models[name]

    def ctx_of(unified: bool) -> Context:
        params = ContextParams(
            n_ctx=256 if unified else 1024,
            n_seq_max=4,
            kv_unified=unified,
            swa_full=True,
            type_k=type_kv,
            type_v=type_kv,
        )
        return Context(model, params)

    p, cont = tokens(20, seed=1), tokens(2, seed=2)
    ctx = ctx_of(unified)
    ctx.decode(Batch.from_tokens(p))
    ctx.memory.seq_rm(0, 2, 8)
    ctx.memory.seq_add(0, 8, -1, -6)
    got = decode_each(ctx, {0: cont}, {0: 14})[0]
    ref = ctx_of(True)
    ref.decode(Batch.from_tokens(p[:2] + p[8:]))
    torch.testing.assert_close(got, decode_each(ref, {0: cont}, {0: 14})[0], rtol=0, atol=atol)


# -- kvtool.context_shift: the one place the tools shift a sequence ------------------------------
@pytest.mark.parametrize("unified", [True, False])
def test_context_shift_function_equals_fresh_decode(models: dict[str, kvtool.Model], unified: bool) -> None:
    model = models["llama"]
    p, cont = tokens(30, seed=3), tokens(2, seed=4)
    ctx = context(model, unified)
    ctx.decode(Batch.from_tokens(p))
    kvtool.context_shift(ctx, 0, 3, 13)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, 16)
    got = decode_each(ctx, {0: cont}, {0: 17})[0]
    torch.testing.assert_close(got, fresh(model, p[:3] + p[16:], cont), **tol("llama"))


def test_context_shift_refused_by_a_window_cache_smaller_than_the_context(
    models: dict[str, kvtool.Model],
) -> None:
    """A window cache of 256 cells beside a 1024-cell base cache has forgotten what a shift would
    need: refused, nothing changed."""
    ctx = Context(models["gemma3-swa"], ContextParams(n_ctx=1024, n_ubatch=8))
    assert not ctx.memory.can_shift()
    ctx.decode(Batch.from_tokens(tokens(10, seed=5)))
    with pytest.raises(kvtool.KvtoolError, match="cannot shift"):
        kvtool.context_shift(ctx, 0, 2, 4)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0), ctx.n_used_cells()) == (0, 9, 10)
