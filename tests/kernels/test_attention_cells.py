"""Attention that decides visibility from cell metadata inside the Triton kernel (run by the
interpreter), against the reference that builds the dense mask; the mask rule against the
engine's own (kvtool.memory.kv_cells.SWAParams) in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.kernels.attention_ref import attention_cells_ref
from kvtool.kernels.attention_triton import attention_triton
from kvtool.kernels.visibility import Cells, visible_ref
from kvtool.memory.kv_cells import SWAParams
from tests.kernels.attention_inputs import TOL
from tests.kernels.cells_inputs import CellCase, make_cells, make_qkv

CASES = [
    # decode: one query per stream
    CellCase("decode_gqa4_streams4", 4, 1, 8, 2, 64, 90),
    CellCase("decode_split3", 1, 1, 4, 1, 32, 150, n_split=3, block_n=16),
    CellCase("decode_unified_2seq_split", 1, 1, 4, 2, 32, 120, n_seq=2, n_split=4, block_n=16),
    CellCase(
        "decode_swa_ordered_split", 2, 1, 2, 2, 16, 130, swa="standard", n_swa=20, ordered=True, n_split=4
    ),
    # prompt: several queries per stream
    CellCase("prompt_causal", 1, 20, 4, 4, 32, 45),
    CellCase("prompt_gqa2_streams3", 3, 7, 4, 2, 16, 33),
    CellCase("prompt_unified_3seq", 1, 12, 2, 1, 32, 50, n_seq=3),
    CellCase("prompt_swa_standard", 2, 9, 2, 1, 16, 70, swa="standard", n_swa=8, ordered=True, block_n=16),
    CellCase("prompt_swa_chunked", 1, 10, 2, 2, 16, 60, swa="chunked", n_swa=16, ordered=True),
    CellCase("prompt_swa_symmetric", 1, 6, 2, 2, 16, 40, swa="symmetric", n_swa=10, causal=False),
    CellCase("prompt_not_causal", 2, 5, 2, 1, 16, 30, n_seq=2, causal=False),
    # head sizes that are not powers of two, and a large one
    CellCase("head_dim_48", 2, 3, 4, 4, 48, 33),
    CellCase("head_dim_80_gqa2", 1, 4, 4, 2, 80, 40),
    CellCase("head_dim_256", 1, 2, 2, 1, 256, 24),
]


def _check(c: CellCase, q_dtype: torch.dtype, kv_dtype: torch.dtype, seed: int) -> None:
    cells = make_cells(c, seed)
    q, k, v = make_qkv(c, kv_dtype, seed)
    q = q.to(q_dtype)
    scale = 1.0 / math.sqrt(c.head_dim)
    got = attention_triton(q, k, v, cells, scale, n_split=c.n_split, block_n=c.block_n)
    want = attention_cells_ref(q, k, v, cells, scale)
    assert got.shape == (c.n_stream, c.n_q, c.n_head, c.head_dim) and got.dtype == q_dtype
    torch.testing.assert_close(got, want, **TOL[q_dtype], msg=lambda m: f"{c}: {m}")
    blind = ~visible_ref(cells).any(-1)  # [S, n_q]: rows that see no cell give zeros
    assert (got[blind] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cells_kernel_matches_reference(case: CellCase, dtype: torch.dtype) -> None:
    _check(case, dtype, dtype, seed=CASES.index(case))


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [(torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
    ids=["f32_on_f16", "f32_on_bf16", "bf16"],
)
@pytest.mark.parametrize("case", [CASES[2], CASES[6], CASES[7]], ids=lambda c: c.name)
def test_cells_kernel_mixed_dtypes(case: CellCase, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    # activations in fp32 (or bf16) on a 16-bit cache: the kernel computes in fp32
    _check(case, q_dtype, kv_dtype, seed=7)


def test_invisible_tiles_are_never_loaded() -> None:
    # Sequence 0 holds cells 0..47 and sequence 1 cells 48..95 of one unified stream; the
    # queries are sequence 0's, with a window of 16 at positions 40..47. Every tile of 16
    # cells but the last two of sequence 0 is invisible: poisoned with NaN there, the output
    # stays finite only if those tiles' K and V are skipped, not merely weighted by zero.
    n_kv, n_q = 96, 8
    pos = torch.cat([torch.arange(48), torch.arange(48)])[None]  # [1, n_kv]
    seq = torch.cat([torch.ones(48, dtype=torch.int64), torch.full((48,), 2)])[None]
    q_pos = torch.arange(40, 48)[None]
    cells = Cells(pos, seq, q_pos, torch.zeros(1, n_q, dtype=torch.int64), "standard", 16)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, n_q, 2, 16, generator=g)
    k, v = torch.randn(1, n_kv, 1, 16, generator=g), torch.randn(1, n_kv, 1, 16, generator=g)
    want = attention_cells_ref(q, k, v, cells, 0.25)
    k[:, :16], v[:, :16] = float("nan"), float("nan")  # out of the window
    k[:, 48:], v[:, 48:] = float("nan"), float("nan")  # the other sequence
    for n_split in (1, 3):
        got = attention_triton(q, k, v, cells, 0.25, block_n=16, n_split=n_split)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def _visible_python(cells: Cells, s: int, i: int, j: int) -> bool:
    """One (query, cell) pair as the KV cache decides it, in plain Python."""
    cp, cs = int(cells.pos[s, j]), int(cells.seq[s, j])
    qp, qs = int(cells.q_pos[s, i]), int(cells.q_seq[s, i])
    if cp < 0 or not (cs >> qs) & 1 or (cells.causal and cp > qp):
        return False
    if cells.swa == "none":
        return True
    return not bool(SWAParams(cells.n_swa, cells.swa).masked(cp, qp))


@pytest.mark.parametrize("case", CASES[4:11], ids=lambda c: c.name)
def test_visibility_rule_matches_the_kv_cache(case: CellCase) -> None:
    cells = make_cells(case, seed=3)
    got = visible_ref(cells)
    S, n_q, n_kv = got.shape
    want = [[[_visible_python(cells, s, i, j) for j in range(n_kv)] for i in range(n_q)] for s in range(S)]
    assert got.tolist() == want
    assert got.any() and not got.all()  # the cases are not trivial


def test_sequence_63_uses_the_top_bit() -> None:
    # the bitset is a uint64 held in int64: sequence 63 is the sign bit
    pos = torch.tensor([[0, 1, 2]])
    top = -(1 << 63)  # bit 63 alone
    seq = torch.tensor([[top, 1, top | 1]])  # sequence 63, sequence 0, both
    cells = Cells(pos, seq, torch.tensor([[2]]), torch.tensor([[63]]))
    assert visible_ref(cells).tolist() == [[[True, False, True]]]
    q = torch.randn(1, 1, 1, 16)
    kv = torch.randn(1, 3, 1, 16)
    got = attention_triton(q, kv, kv, cells, 0.25)
    torch.testing.assert_close(got, attention_cells_ref(q, kv, kv, cells, 0.25), **TOL[torch.float32])
