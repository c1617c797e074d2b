"""attention: the Triton kernel against the torch reference, the reference against the math.

The Triton kernel runs under TRITON_INTERPRET=1 (set in tests/conftest.py) on CPU tensors,
on the inputs of tests/kernels/attention_inputs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.kernels import attention_ref as attention_ref_mod
from kvtool.kernels.attention_ref import attention_blocks, attention_ref
from kvtool.kernels.attention_triton import attention_triton
from kvtool.kernels.kq_mask import KQMask
from tests.kernels.attention_inputs import CASES, TOL, Case, Pick, make_inputs, random_case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_matches_reference(case: Case, dtype: torch.dtype) -> None:
    q, k, v, mask = make_inputs(case, dtype, seed=CASES.index(case))
    scale = 1.0 / math.sqrt(case.head_dim)
    got = attention_triton(q, k, v, mask, scale, block_m=case.block_m, block_n=case.block_n)
    want = attention_ref(q, k, v, mask, scale)
    assert got.shape == (case.n_stream, case.n_q, case.n_head, case.head_dim_v)
    assert got.dtype == dtype
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[dtype])
    dead = torch.isneginf(mask).all(-1)  # [S, n_q]
    assert (got[dead] == 0).all()
    if case.layout == "masked_row":
        assert dead.sum() == 2


@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference_random_shapes(seed: int) -> None:
    pick = Pick(100 + seed)
    case = random_case(
        pick, f"random{seed}", n_q=[1, 3, 17], n_kv=(1, 80), ratio=[1, 2, 3], block_n=[16, 32, None]
    )
    dtype = pick([torch.float32, torch.float16])
    q, k, v, mask = make_inputs(case, dtype, seed=seed)
    got = attention_triton(q, k, v, mask, 0.3, block_m=case.block_m, block_n=case.block_n)
    want = attention_ref(q, k, v, mask, 0.3)
    torch.testing.assert_close(got, want, **TOL[dtype], msg=lambda m: f"{case}: {m}")


def test_triton_bf16_upcasts() -> None:
    q, k, v, mask = make_inputs(CASES[2], torch.bfloat16, seed=3)
    got = attention_triton(q, k, v, mask, 0.25, block_m=16, block_n=16)
    torch.testing.assert_close(got, attention_ref(q, k, v, mask, 0.25), **TOL[torch.bfloat16])


def test_triton_mixed_dtypes_fp32_q_fp16_cache() -> None:
    q, k, v, mask = make_inputs(CASES[0], torch.float16, seed=4)
    q = q.float()  # activations in fp32, cache in fp16: the kernel computes in fp32
    got = attention_triton(q, k, v, mask, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, attention_ref(q, k, v, mask, 0.125), **TOL[torch.float32])


def test_triton_rejects_small_blocks() -> None:
    q, k, v, mask = make_inputs(CASES[0], torch.float32, seed=5)
    with pytest.raises(AssertionError, match="block sizes"):
        attention_triton(q, k, v, mask, 0.125, block_n=8)


def naive_attention(q, k, v, mask, scale):  # float64, loops over heads, explicit softmax
    S, n_q, H, _ = q.shape
    group = H // k.shape[2]
    out = torch.zeros(S, n_q, H, v.shape[-1], dtype=torch.float64)
    for h in range(H):
        qh = q[:, :, h].double()  # [S, n_q, D]
        kh, vh = k[:, :, h // group].double(), v[:, :, h // group].double()  # [S, n_kv, D]
        logits = scale * qh @ kh.transpose(1, 2) + mask.double()  # [S, n_q, n_kv]
        top = logits.amax(-1, keepdim=True)
        w = torch.exp(logits - torch.where(torch.isneginf(top), 0.0, top))
        total = w.sum(-1, keepdim=True)
        out[:, :, h] = (w / torch.where(total == 0, 1.0, total)) @ vh
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_naive_float64(case: Case) -> None:
    q, k, v, mask = make_inputs(case, torch.float32, seed=11)
    scale = 1.0 / math.sqrt(case.head_dim)
    got = attention_ref(q, k, v, mask, scale)
    torch.testing.assert_close(got.double(), naive_attention(q, k, v, mask, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_q", [1, 3], ids=["decode", "prompt"])
def test_mask_prepared_once_serves_every_layer(n_q: int) -> None:
    # One KQMask per ubatch, shared by layers of different group sizes and asked for again,
    # gives what a mask prepared afresh per layer gives, and the math (a row that sees nothing
    # gives zeros, not NaN).
    S, n_kv, H, D = 2, 9, 6, 8
    g = torch.Generator().manual_seed(n_q)
    mask = torch.zeros(S, n_q, n_kv)
    mask[0, :, 5:] = float("-inf")
    mask[1, -1, :] = float("-inf")  # a row that sees no key
    shared = KQMask(mask)
    assert shared.empty is not None
    for n_head_kv in (6, 3, 2, 1, 3):
        q = torch.randn(S, n_q, H, D, generator=g)
        k, v = torch.randn(2, S, n_kv, n_head_kv, D, generator=g)
        got = attention_ref(q, k, v, shared, 0.3)
        assert torch.equal(got, attention_ref(q, k, v, KQMask(mask.clone()), 0.3))
        torch.testing.assert_close(got.double(), naive_attention(q, k, v, mask, 0.3), atol=1e-5, rtol=1e-5)
        assert (got[1, -1] == 0).all()


def test_mask_without_empty_rows_needs_no_fixup() -> None:
    mask = torch.zeros(1, 2, 4)
    mask[0, 0, 3] = float("-inf")
    m = KQMask(mask)
    assert m.empty is None
    assert m.grouped(2).shape == (1, 1, 4, 4) and m.grouped(1).shape == (1, 1, 2, 4)
    assert torch.equal(m.grouped(2)[0, 0, 2:], mask[0])  # rows: (head in group, query)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("case", [c for c in CASES if c.n_q > 1], ids=lambda c: c.name)
def test_blocks_of_query_rows_over_the_keys_they_see_match_the_reference(
    case: Case, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts on the CPU: SDPA per block of query rows, over the range of keys the block sees
    (blocks of 4 rows here: every case has several, some seeing a short range or nothing)."""
    monkeypatch.setattr(attention_ref_mod, "Q_BLOCK", 4)
    q, k, v, mask = make_inputs(case, dtype, seed=7)
    scale = 1.0 / math.sqrt(case.head_dim)
    m = KQMask(mask)
    got = attention_blocks(q, k, v, m, scale)
    want = attention_ref(q, k, v, mask, scale)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert (got[torch.isneginf(mask).all(-1)] == 0).all()
    spans = [(k0, k1) for _, _, k0, k1, _ in m.blocks(4)]
    assert spans and all(0 <= k0 < k1 <= case.n_kv for k0, k1 in spans)


def test_a_causal_prompts_blocks_read_the_keys_up_to_their_last_row() -> None:
    n = 10
    mask = torch.zeros(1, n, n).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    mask[0, 8:, :3] = float("-inf")  # a window: the last rows no longer see the first keys
    m = KQMask(mask)
    spans = [(b[0], b[1], b[2], b[3]) for b in m.blocks(4)]
    assert spans == [(0, 4, 0, 4), (4, 8, 0, 8), (8, 10, 3, 10)]
    assert [(b[0], b[1], b[2], b[3]) for b in m.blocks(5)] == [(0, 5, 0, 5), (5, 10, 0, 10)]  # per size
