"""Random mixes of sequence ops (rm, cp, keep, add, div, a sequence state saved and loaded into
another sequence) between decodes, through the public API,
in both KV modes: every decoded row must equal a reference computed from the plain-Python model
of the cells (tests/helpers/ref_memory.py).

The models have one layer, so a cached token's K/V depend only on the token and its position:
the reference places each token the model says a sequence holds, at its current position, in a
context of its own, and decodes the same query there.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams
from tests.helpers.ref_memory import RefMemory, Tok
from tests.helpers.tiny_gemma3 import TinyGemma3, write_tiny_gemma3
from tests.helpers.tiny_gguf import TinyLlama, spm_vocab, write_tiny_llama

N_VOCAB = len(spm_vocab()[0])
N_SEQ = 4
TOL = {"llama": dict(rtol=1e-4, atol=1e-4), "gemma3": dict(rtol=2e-3, atol=2e-3)}  # gemma3: fp16 GELU
# f32 caches: a shifted K row is re-rotated exactly only if it is not rounded again
F32 = {"type_k": "f32", "type_v": "f32"}


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads and lose a lot on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, kvtool.Model]:
    """One layer each: NORM RoPE (llama) and NEOX RoPE with base 1e6 (a gemma3 global layer)."""
    d = tmp_path_factory.mktemp("random_ops")
    return {
        "llama": kvtool.Model(write_tiny_llama(d / "l1.gguf", TinyLlama(n_layer=1, seed=2))),
        "gemma3": kvtool.Model(write_tiny_gemma3(d / "g1.gguf", TinyGemma3(n_layer=1, swa_pattern=[False]))),
    }


def reference(model: kvtool.Model, cells: list[tuple[int, int]], query: int, qpos: int) -> torch.Tensor:
    """The logits of `query` at `qpos` over a sequence holding `cells` (token, pos), duplicate
    positions allowed: each token is decoded in a sequence of its own (1..63, one batch), then
    shared into sequence 0 of the one stream."""
    ctx = Context(model, ContextParams(n_ctx=512, n_seq_max=64, kv_unified=True, **F32))
    for i in range(0, len(cells), 63):
        chunk = cells[i : i + 63]
        b = Batch()
        for k, (t, p) in enumerate(chunk):
            b.add(t, p, [k + 1], False)
        ctx.decode(b)
        for k in range(len(chunk)):
            ctx.memory.seq_cp(k + 1, 0, -1, -1)
            ctx.memory.seq_rm(k + 1, -1, -1)
    ctx.decode(Batch.from_tokens([query], pos0=qpos))
    return ctx.logits()[0].clone()


def random_op(rng: random.Random, ctx: Context, ref: RefMemory) -> tuple[str, Context]:
    """Applies one random op to the context and the model; returns its name and the context
    (a whole-context state moves everything into a new one)."""
    op = rng.choice(["rm", "cp", "cp", "keep", "add", "add", "div", "state", "context"])
    s = rng.randrange(-1 if op == "rm" else 0, N_SEQ)
    p0 = rng.choice([-1, rng.randrange(0, 10)])
    p1 = rng.choice([-1, rng.randrange(0, 12)])
    mem = ctx.memory
    if op == "rm":
        assert mem.seq_rm(s, p0, p1)
        ref.seq_rm(s, p0, p1)
    elif op == "cp":
        d = rng.randrange(N_SEQ)
        assert ref.seq_cp(s, d, p0, p1)  # 256 cells per stream: always room
        mem.seq_cp(s, d, p0, p1)
    elif op == "state":
        d = rng.randrange(N_SEQ)
        ctx.state_seq_set_data(ctx.state_seq_get_data(s), d)
        ref.seq_load(s, d)
        return f"state({s} -> {d})", ctx
    elif op == "context":
        new = Context(ctx.model, ctx.params)
        new.state_set_data(ctx.state_get_data())
        return "context state", new
    elif op == "keep":
        mem.seq_keep(s)
        ref.seq_keep(s)
    elif op == "add":
        d = rng.randint(-4, 4)
        mem.seq_add(s, p0, p1, d)
        ref.seq_add(s, p0, p1, d)
    else:
        d = rng.randint(1, 3)
        mem.seq_div(s, p0, p1, d)
        ref.seq_div(s, p0, p1, d)
    return f"{op}({s}, {p0}, {p1})", ctx


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("seed", range(6))
def test_random_seq_ops_then_decode(
    models: dict[str, kvtool.Model], name: str, seed: int, unified: bool
) -> None:
    model, tol = models[name], TOL[name]
    rng = random.Random(seed)
    ctx = Context(
        model, ContextParams(n_ctx=256 if unified else 1024, n_seq_max=N_SEQ, kv_unified=unified, **F32)
    )
    ref = RefMemory(ctx.n_ctx_seq, N_SEQ, unified)
    b = Batch()
    for s in range(N_SEQ):
        for p in range(rng.randint(4, 9)):
            t = rng.randrange(3, N_VOCAB)
            b.add(t, p, [s], False)
            ref.place(s, Tok(p, p, {s}, t, None))
    ctx.decode(b)
    history: list[str] = []
    for _ in range(4):
        for _ in range(rng.randint(1, 6)):
            name_op, ctx = random_op(rng, ctx, ref)
            history.append(name_op)
        b, queries = Batch(), []
        for s in range(N_SEQ):
            q, qpos = rng.randrange(3, N_VOCAB), max(ref.positions(s), default=-1) + 1
            b.add(q, qpos, [s], True)
            queries.append((s, q, qpos))
        ctx.decode(b)  # applies the pending shifts first
        ref.update()
        for row, (s, q, qpos) in enumerate(queries):
            cells = [(t.tag, t.pos) for t in ref.stream(s) if s in t.seqs]
            want = reference(model, cells, q, qpos)
            where = f"seq {s} after {history}"
            torch.testing.assert_close(ctx.logits()[row], want, **tol, msg=lambda m, w=where: f"{w}: {m}")
            ref.place(s, Tok(qpos, qpos, {s}, q, None))
