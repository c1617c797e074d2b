"""Position shifts over f16 and quantized caches: a shifted K row is dequantized, rotated back
out of llama.cpp's Hadamard basis, re-rotated by its delta, rotated in and quantized again
(llama.cpp's build_rope_shift for a quantized cache), and only shifted rows are rewritten.
Exactness on f32 caches is tests/kvtool/test_context_shift.py's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import kvtool
from kvtool import Batch, Context, ContextParams
from kvtool.kernels.hadamard import fwht
from kvtool.kernels.kv_quant import KV_TYPES, dequantize, quantize
from tests.helpers.tiny_gguf import TinyLlama, write_tiny_llama


@pytest.fixture(scope="module")
def llama64(tmp_path_factory: pytest.TempPathFactory) -> kvtool.Model:
    """One layer, heads of 64: every type fits, and quantized K/V take the rotation."""
    cfg = TinyLlama(n_embd=128, n_layer=1, n_head=2, n_head_kv=1, seed=5)
    return kvtool.Model(write_tiny_llama(Path(tmp_path_factory.mktemp("s")) / "l64.gguf", cfg))


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 250, size=n).tolist()


@pytest.mark.parametrize("type_k", ["q8_0", "q4_1", "iq4_nl", "f16"])
@pytest.mark.parametrize("rot", [True, False])
def test_shifted_rows_are_dequantized_rotated_and_quantized(
    llama64: kvtool.Model, type_k: str, rot: bool
) -> None:
    ctx = Context(
        llama64, ContextParams(n_ctx=256, n_seq_max=2, kv_unified=True, type_k=type_k, attn_rot=rot)
    )
    ctx.decode(Batch.from_tokens(tokens(20, 1), seq_id=0))
    ctx.decode(Batch.from_tokens(tokens(10, 2), seq_id=1))
    cache = ctx.memory
    assert cache.rot_k == (64 if rot and type_k != "f16" else 0)
    before = cache.k[0][0].clone()  # [n_cells, n_head_kv, width]
    cells = cache.cells[0]
    moved = np.flatnonzero(cells.has_seq(0) & (cells.pos >= 5))  # seq 0's positions 5..19
    ctx.memory.seq_add(0, 5, -1, 7)
    ctx.update()
    t = KV_TYPES[type_k]
    rows = dequantize(before[moved], t, 64)
    if cache.rot_k:
        rows = fwht(rows, cache.rot_k)
    rows = llama64.impl.kv.rope_shift(0, rows, torch.full((len(moved),), 7))
    if cache.rot_k:
        rows = fwht(rows, cache.rot_k)
    after = cache.k[0][0]
    assert torch.equal(after[moved].view(torch.uint8), quantize(rows, t).view(torch.uint8))
    kept = np.setdiff1d(np.arange(cells.size), moved)
    assert torch.equal(after[kept], before[kept])  # other rows are not quantized again


@pytest.mark.parametrize("type_k", ["q8_0", "q4_0", "q5_1"])
def test_a_whole_sequence_shift_keeps_what_it_computes(llama64: kvtool.Model, type_k: str) -> None:
    """RoPE is relative: after moving every token by 40 the next logits are what they were, up
    to the rounding of K quantized again; without the re-rotation they are not."""

    def run(shift: bool) -> torch.Tensor:
        ctx = Context(llama64, ContextParams(n_ctx=256, type_k=type_k, type_v=type_k))
        ctx.decode(Batch.from_tokens(tokens(60, 3)))
        if shift:
            ctx.memory.seq_add(0, -1, -1, 40)
        pos = ctx.memory.seq_pos_max(0) + 1
        ctx.decode(Batch.from_tokens([7, 8, 9], pos0=pos, logits="all"))
        return ctx.logits().clone()

    still, shifted = run(False), run(True)
    err = float((shifted - still).abs().max() / still.abs().max())
    # measured 0.003, 0.024, 0.0096 of the largest logit; left stale, 0.17 to 0.19
    assert err < {"q8_0": 0.01, "q4_0": 0.06, "q5_1": 0.03}[type_k], err
    import kvtool.memory.kv_update as upd

    real = upd.KVUpdateContext._shift
    try:
        upd.KVUpdateContext._shift = lambda self: [c.take_shift() for c in self.cache.cells if c.has_shift]  # type: ignore[method-assign]
        stale = run(True)
    finally:
        upd.KVUpdateContext._shift = real  # type: ignore[method-assign]
    assert float((stale - still).abs().max() / still.abs().max()) > 3 * err
