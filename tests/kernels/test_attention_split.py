"""Split-KV attention (flash-decoding): the keys of a row block are shared by several programs,
whose partial softmax states a reduction kernel merges. Checked against `attention_ref` under
the interpreter, with the launch policy that decides when to split."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels import attention_triton as attention_triton_mod
from kvtool.kernels.attention_ref import attention_ref
from kvtool.kernels.attention_split import _n_split
from kvtool.kernels.attention_triton import attention_triton
from tests.kernels.attention_inputs import TOL, Case, Pick, make_inputs, random_case

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class LaunchSpy:
    """Stands in for a kernel and records the grids it is launched on."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def reduce_spy(monkeypatch: pytest.MonkeyPatch) -> LaunchSpy:
    spy = LaunchSpy(attention_triton_mod._attention_reduce_kernel)
    monkeypatch.setattr(attention_triton_mod, "_attention_reduce_kernel", spy)
    return spy


@pytest.mark.parametrize("seed", range(2 * len(DTYPES) ** 2))
def test_split_matches_reference_random_shapes(seed: int, reduce_spy: LaunchSpy) -> None:
    pick = Pick(200 + seed)
    # Decode-sized row blocks over more keys than one tile (so that every split count >= 2
    # leaves at least two splits); SWA cells are in order, so whole splits fall outside.
    case = random_case(pick, f"split{seed}", n_q=[1, 2, 5], n_kv=(33, 160), ratio=[1, 2, 4], block_n=[16, 32])
    # every pair of (activations, cache) dtypes twice: fp32 on an f16 cache, bf16 on fp32, ...
    q_dtype, kv_dtype = DTYPES[seed % 3], DTYPES[seed // 3 % 3]
    n_split = pick([2, 3, 5, 8])
    q, k, v, mask = make_inputs(case, kv_dtype, seed=seed)
    q = q.to(q_dtype)
    got = attention_triton(q, k, v, mask, 0.3, block_m=case.block_m, block_n=case.block_n, n_split=n_split)
    assert len(reduce_spy.grids) == 1
    assert got.dtype == q_dtype
    want = attention_ref(q, k, v, mask, 0.3)
    # fp16 everywhere takes fp16 dots; any other mix computes in fp32 and rounds to q's dtype.
    torch.testing.assert_close(got, want, **TOL[q_dtype], msg=lambda m: f"{case} {kv_dtype} {n_split}: {m}")
    dead = torch.isneginf(mask).all(-1)  # [S, n_q]
    assert (got[dead] == 0).all()


def test_split_rows_that_see_keys_in_one_split_only(reduce_spy: LaunchSpy) -> None:
    # Row 0 sees only keys 0..15 (the first split), row 1 only keys 112..127 (the last),
    # row 2 nothing: every other split of each row is empty and must not count.
    case = Case("edges", 1, 3, 2, 1, 16, 16, 128, "causal")
    q, k, v, _ = make_inputs(case, torch.float32, seed=1)
    mask = torch.full((1, 3, 128), float("-inf"))
    mask[0, 0, :16] = 0
    mask[0, 1, 112:] = 0
    got = attention_triton(q, k, v, mask, 0.5, block_n=16, n_split=8)
    assert reduce_spy.grids == [(1, 1)]
    torch.testing.assert_close(got, attention_ref(q, k, v, mask, 0.5), **TOL[torch.float32])
    assert (got[0, 2] == 0).all()


def test_long_decode_splits_by_default_and_prompt_does_not(reduce_spy: LaunchSpy) -> None:
    decode = Case("long_decode", 1, 1, 4, 2, 16, 16, 600, "causal")
    q, k, v, mask = make_inputs(decode, torch.float16, seed=2)
    got = attention_triton(q, k, v, mask, 0.25)
    assert len(reduce_spy.grids) == 1
    torch.testing.assert_close(got, attention_ref(q, k, v, mask, 0.25), **TOL[torch.float16])

    prompt = Case("prompt", 1, 40, 4, 2, 16, 16, 600, "causal")  # 80 rows: two row blocks
    q, k, v, mask = make_inputs(prompt, torch.float32, seed=3)
    got = attention_triton(q, k, v, mask, 0.25)
    assert len(reduce_spy.grids) == 1  # no second reduction
    torch.testing.assert_close(got, attention_ref(q, k, v, mask, 0.25), **TOL[torch.float32])


def test_split_policy() -> None:
    n_sm = 132
    # one stream, 8 KV heads, 4k cells: 16 splits of 256 keys (128 programs)
    assert _n_split(1, 8, 4096, n_sm) == 16
    # 32k cells: limited by two programs per SM, cdiv(264, 8) = 33
    assert _n_split(1, 8, 32768, n_sm) == 33
    # 64 streams x 8 heads already fill the GPU; short caches and prompts are not split
    assert _n_split(1, 512, 4096, n_sm) == 1
    assert _n_split(1, 8, 300, n_sm) == 1
    assert _n_split(2, 8, 4096, n_sm) == 1
