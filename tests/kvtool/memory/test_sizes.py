"""Memory.memory_breakdown on the tiny models: each part (named as its composite names it) says
its bytes in its types, counted from the model's shapes by plain arithmetic, and the cells each
stream uses; the spec says the same before anything is allocated."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import kvtool

MODELS = Path(__file__).parents[2] / "data" / "tiny" / "models"
ROW_BYTES = {"f32": 128, "f16": 64, "bf16": 64, "q8_0": 34, "q4_0": 18, "q5_1": 24}  # per 32 values


@functools.cache
def model(arch: str) -> kvtool.Model:
    return kvtool.Model(MODELS / f"tiny-{arch}.gguf")


def kv_bytes(m: kvtool.Model, layers: list[int], rows: int, type_k: str, type_v: str) -> tuple[int, int]:
    hp = m.hparams
    k = sum(hp.n_head_kv[il] * hp.head_dim_k // 32 * ROW_BYTES[type_k] for il in layers)
    v = sum(hp.n_head_kv[il] * hp.head_dim_v // 32 * ROW_BYTES[type_v] for il in layers)
    return rows * k, rows * v


@pytest.mark.parametrize(("unified", "types"), [(False, ("f32", "f32")), (True, ("f16", "bf16"))])
def test_a_kv_cache_counts_its_tensors_and_cells_per_stream(unified: bool, types: tuple[str, str]) -> None:
    m = model("llama")
    p = kvtool.ContextParams(n_ctx=512, n_seq_max=2, kv_unified=unified, type_k=types[0], type_v=types[1])
    ctx = kvtool.Context(m, p)
    assert ctx.memory_breakdown() == kvtool.Context.memory_breakdown_of(m, p)  # before any token
    kvtool.decode_tokens(ctx, [5, 6, 7], 0, 0)
    kvtool.decode_tokens(ctx, [5, 6, 7, 8, 9], 1, 0)
    (b,) = ctx.memory_breakdown().parts
    n_stream = 1 if unified else 2
    assert (b.part, b.kind, b.n_stream, b.n_cells) == ("", "attention", n_stream, ctx.n_ctx_seq)
    assert (b.k, b.v) == kv_bytes(m, list(range(m.hparams.n_layer)), n_stream * b.n_cells, *types)
    assert b.used == ((8,) if unified else (3, 5))
    ctx.memory.seq_rm(1, 2, -1)
    assert ctx.memory_breakdown().parts[0].used == ((5,) if unified else (3, 2))


@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "q4_0"), ("q5_1", "f32")])
def test_a_sliding_window_pair_reports_both_caches_in_their_types(types: tuple[str, str]) -> None:
    m = model("gemma3")  # heads of 32: every block type tiles them
    p = kvtool.ContextParams(n_ctx=1024, n_ubatch=64, type_k=types[0], type_v=types[1])
    ctx = kvtool.Context(m, p)
    kvtool.decode_tokens(ctx, list(range(3, 40)), 0, 0)
    held = ctx.memory_breakdown()
    parts = {b.part: b for b in held.parts}
    assert {n: b.kind for n, b in parts.items()} == {"base": "attention", "swa": "sliding_window"}
    assert parts["base"].used == (37,)
    assert (parts["base"].n_cells, parts["swa"].n_cells) == (1024, 256)  # pad256(window 8 + ubatch 64)
    swa = sorted(m.memory_spec().swa_layers)
    base = [il for il in range(m.hparams.n_layer) if il not in swa]
    for name, layers in (("base", base), ("swa", swa)):
        b = parts[name]
        assert (b.k, b.v) == kv_bytes(m, layers, b.n_cells, *types)
        assert (b.type_k, b.type_v) == types
    assert held.kv_bytes == held.total and held.states == 0


def test_a_hybrid_names_its_recurrent_and_attention_parts() -> None:
    m = model("granitehybrid")
    p = kvtool.ContextParams(n_ctx=256, n_seq_max=2)
    ctx = kvtool.Context(m, p)
    before = kvtool.Context.memory_breakdown_of(m, p)
    assert before == ctx.memory_breakdown()
    kvtool.decode_tokens(ctx, [5, 6, 7, 8], 0, 0)
    held = ctx.memory_breakdown()
    parts = {b.part: b for b in held.parts}
    assert {n: b.kind for n, b in parts.items()} == {"recurrent": "recurrent", "attn": "attention"}
    assert parts["recurrent"].used == (1,) and parts["recurrent"].n_cells == 2  # state slots
    assert parts["attn"].used == (4, 0)
    assert held.states == parts["recurrent"].nbytes > 0 and held.kv_bytes == parts["attn"].nbytes > 0


@pytest.mark.parametrize("n_rs_seq", [0, 3])
def test_a_recurrent_memory_counts_its_states_and_snapshots(n_rs_seq: int) -> None:
    """One part of n_seq_max state slots (the slot a sequence took is used), its bytes every
    slot's F32 states and each of their n_rs_seq snapshots."""
    m = model("mamba2")
    p = kvtool.ContextParams(n_ctx=768, n_seq_max=3, n_rs_seq=n_rs_seq)
    ctx = kvtool.Context(m, p)
    kvtool.decode_tokens(ctx, [5, 6, 7], 2, 0)
    (b,) = ctx.memory_breakdown().parts
    assert (b.part, b.kind, b.n_cells, b.used) == ("", "recurrent", 3, (1,))
    assert b.nbytes == ctx.memory_breakdown().states
    alone = kvtool.Context(m, kvtool.ContextParams(n_ctx=768, n_seq_max=3))
    assert b.nbytes == (1 + n_rs_seq) * alone.memory_breakdown().states  # snapshots are states
    states = ctx.memory.states.t  # type: ignore[attr-defined]
    per_slot = sum(t[0].numel() for name in ("conv", "ssm") for t in states[name].values())
    assert b.nbytes == 3 * 4 * (1 + n_rs_seq) * per_slot
