"""Soft-capped attention (Gemma 2; `softcap` of kernels/attention_ref.py and kernels/attention.py)
against the plain math, and the compiled CPU kernel's cap (attention_cpu.c) against that
specification."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.kernels import attention_cpu
from kvtool.kernels.attention import attention
from kvtool.kernels.attention_ref import attention_ref
from kvtool.kernels.kq_mask import KQMask


def _inputs(n_q: int, kv_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(n_q)
    S, H, Hkv, D, n_kv = 2, 4, 2, 32, 40
    q = torch.randn(S, n_q, H, D, generator=g) * 3  # scores well past the cap
    k = torch.randn(S, n_kv, Hkv, D, generator=g).to(kv_dtype)
    v = torch.randn(S, n_kv, Hkv, D, generator=g).to(kv_dtype)
    mask = torch.zeros(S, n_q, n_kv)
    mask[:, :, 30:] = -math.inf
    mask[1, -1, :] = -math.inf  # a row that sees nothing
    return q, k, v, mask


def test_the_reference_is_the_capped_softmax() -> None:
    q, k, v, mask = _inputs(3)
    got = attention_ref(q, k, v, mask, 0.2, softcap=5.0)
    for s in range(2):
        for i in range(3):
            for h in range(4):
                scores = (k[s, :, h // 2] @ q[s, i, h]) * 0.2
                p = torch.softmax(5.0 * torch.tanh(scores / 5.0) + mask[s, i], dim=0)
                want = torch.zeros(32) if torch.isinf(mask[s, i]).all() else p @ v[s, :, h // 2]
                torch.testing.assert_close(got[s, i, h], want, rtol=1e-5, atol=1e-6)
    plain = torch.softmax(
        (torch.einsum("sqhd,skhd->shqk", q, k.repeat_interleave(2, 2)) * 0.2) + mask[:, None], -1
    )
    assert not torch.allclose(got[0, 0, 0], (plain[0, 0, 0] @ v[0, :, 0]), atol=1e-3)  # the cap matters here


@pytest.mark.skipif(attention_cpu.cpu_lib.lib() is None, reason="no C compiler: the kernel is not built")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q", [1, 3])
def test_the_compiled_kernel_caps_as_the_reference(kv_dtype: torch.dtype, n_q: int) -> None:
    q, k, v, mask = _inputs(n_q, kv_dtype)
    want = attention_ref(q, k.float(), v.float(), mask, 0.2, softcap=5.0)
    got = attention(q, k, v, KQMask(mask), 0.2, softcap=5.0)  # few rows on the CPU: the kernel
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prompts_run_by_blocks_of_query_rows() -> None:
    n = 300  # more than one block of 128 rows, causal
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 16, generator=g) for _ in range(3))
    causal = torch.full((n, n), -math.inf).triu(1)[None]
    want = attention_ref(q, k, v, causal, 0.25, softcap=3.0)
    torch.testing.assert_close(
        attention(q, k, v, KQMask(causal), 0.25, softcap=3.0), want, rtol=1e-5, atol=1e-6
    )
