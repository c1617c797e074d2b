"""Memory.breakdown on the tiny models: every kind says how many bytes it holds and how many of
its cells each stream uses, checked against the plain arithmetic of the model's shapes."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import kvtool

MODELS = Path(__file__).parent.parent.parent / "data" / "tiny" / "models"
SIZE = {"f32": 4, "f16": 2, "bf16": 2}


@functools.cache
def model(arch: str) -> kvtool.Model:
    return kvtool.Model(MODELS / f"tiny-{arch}.gguf")


def kv_bytes(
    m: kvtool.Model, layers: list[int], n_stream: int, n_cells: int, type_k: str, type_v: str
) -> int:
    hp = m.hparams
    per_cell = sum(
        hp.n_head_kv[il] * (hp.head_dim_k * SIZE[type_k] + hp.head_dim_v * SIZE[type_v]) for il in layers
    )
    return n_stream * n_cells * per_cell


@pytest.mark.parametrize(("unified", "types"), [(False, ("f16", "f16")), (True, ("f16", "bf16"))])
def test_a_kv_cache_counts_its_tensors_and_its_cells_per_stream(
    unified: bool, types: tuple[str, str]
) -> None:
    m = model("llama")
    p = kvtool.ContextParams(n_ctx=512, n_seq_max=2, kv_unified=unified, type_k=types[0], type_v=types[1])
    ctx = kvtool.Context(m, p)
    kvtool.decode_tokens(ctx, [5, 6, 7], 0, 0)
    kvtool.decode_tokens(ctx, [5, 6, 7, 8, 9], 1, 0)
    (b,) = ctx.memory.breakdown()
    n_stream = 1 if unified else 2
    assert (b.part, b.kind) == ("", "attention")
    assert b.n_cells == ctx.n_ctx_seq
    assert b.nbytes == kv_bytes(m, list(range(m.hparams.n_layer)), n_stream, b.n_cells, *types)
    assert b.used == ((8,) if unified else (3, 5))
    ctx.memory.seq_rm(1, 2, -1)
    assert ctx.memory.breakdown()[0].used == ((5,) if unified else (3, 2))


def test_a_sliding_window_pair_reports_both_caches() -> None:
    m = model("gemma3")
    ctx = kvtool.Context(m, kvtool.ContextParams(n_ctx=1024, n_ubatch=64, n_seq_max=1))
    kvtool.decode_tokens(ctx, list(range(3, 40)), 0, 0)
    parts = {b.part: b for b in ctx.memory.breakdown()}
    assert {p: b.kind for p, b in parts.items()} == {"base": "attention", "swa": "sliding_window"}
    assert parts["base"].used == (37,)
    assert (parts["base"].n_cells, parts["swa"].n_cells) == (1024, 256)  # pad256(window 8 + ubatch 64)
    swa = sorted(m.memory_spec().swa_layers)
    assert swa and len(swa) < m.hparams.n_layer
    base = [il for il in range(m.hparams.n_layer) if il not in swa]
    for name, layers in (("base", base), ("swa", swa)):
        b = parts[name]
        assert b.nbytes == kv_bytes(m, layers, 1, b.n_cells, "f16", "f16")


@pytest.mark.parametrize("n_rs_seq", [0, 3])
def test_a_recurrent_memory_counts_its_states_and_snapshots(n_rs_seq: int) -> None:
    m = model("mamba2")
    ctx = kvtool.Context(m, kvtool.ContextParams(n_ctx=768, n_seq_max=3, n_rs_seq=n_rs_seq))
    kvtool.decode_tokens(ctx, [5, 6, 7], 2, 0)
    (b,) = ctx.memory.breakdown()
    assert (b.part, b.kind, b.n_cells, b.used) == ("", "recurrent", 3, (1,))
    assert b.nbytes == ctx.memory_breakdown().recurrent


def test_a_hybrid_reports_its_recurrent_and_attention_parts() -> None:
    ctx = kvtool.Context(model("granitehybrid"), kvtool.ContextParams(n_ctx=256, n_seq_max=2))
    kvtool.decode_tokens(ctx, [5, 6, 7, 8], 0, 0)
    parts = {b.part: b for b in ctx.memory.breakdown()}
    assert {p: b.kind for p, b in parts.items()} == {"recurrent": "recurrent", "attn": "attention"}
    assert parts["recurrent"].used == (1,)
    assert parts["attn"].used == (4, 0)
    assert all(b.nbytes > 0 for b in parts.values())
