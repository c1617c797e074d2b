"""Every Triton kernel variant on a device against its torch reference on the CPU.

test_kernels_cuda.py runs `check_all("cuda")` in a process without TRITON_INTERPRET, so the
kernels are compiled for the GPU; on the CPU the same checks run under the interpreter (the
first case of each, `quick`), which keeps this file honest on machines without a GPU. The
inputs are the interpreter tests' own.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvtool.kernels.attention_ref import attention_cells_ref, attention_ref
from kvtool.kernels.attention_triton import attention_triton
from kvtool.kernels.dequant import dequantize
from kvtool.kernels.kv_quant import KV_TYPES
from kvtool.kernels.short_conv import short_conv_ref, short_conv_triton
from kvtool.kernels.ssd import ssd_ref, ssd_triton
from kvtool.kernels.ssm_scan import ssm_scan_ref, ssm_scan_triton
from kvtool.kernels.store_kv import store_kv_ref, store_kv_triton
from kvtool.kernels.visibility import Cells
from kvtool.kernels.wkv6 import wkv6_ref, wkv6_triton
from kvtool.kernels.wkv7 import wkv7_ref, wkv7_triton
from tests.kernels import (
    test_dequant,
    test_kv_triton,
    test_short_conv,
    test_ssd,
    test_ssm_scan,
    test_wkv6,
    test_wkv7,
)
from tests.kernels.attention_inputs import CASES, TOL, make_inputs
from tests.kernels.cells_inputs import make_cells, make_qkv
from tests.kernels.test_attention_cells import CASES as CELL_CASES

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _on(device: str, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in ts]


def check_attention(device: str, quick: bool = False) -> None:
    """The dense-mask kernel: every case, every dtype, one pass and split-KV."""
    for i, case in enumerate(CASES[:1] if quick else CASES):
        for dtype in DTYPES[:1] if quick else DTYPES:
            q, k, v, mask = make_inputs(case, dtype, seed=i)
            scale = 1.0 / math.sqrt(case.head_dim)
            want = attention_ref(q, k, v, mask, scale)
            for n_split in (1, 3):
                got = attention_triton(*_on(device, q, k, v, mask), scale, n_split=n_split)
                torch.testing.assert_close(
                    got.cpu(), want, **TOL[dtype], msg=lambda m, c=case, d=dtype: f"{c} {d}: {m}"
                )


def check_attention_cells(device: str, quick: bool = False) -> None:
    """The cell-metadata kernel: every case, same-type and mixed (fp32 on a 16-bit cache)."""
    pairs = [(d, d) for d in DTYPES] + [(torch.float32, torch.float16), (torch.float32, torch.bfloat16)]
    for i, case in enumerate(CELL_CASES[:1] if quick else CELL_CASES):
        for q_dtype, kv_dtype in pairs[:1] if quick else pairs:
            c = make_cells(case, seed=i)
            q, k, v = make_qkv(case, kv_dtype, seed=i)
            q = q.to(q_dtype)
            scale = 1.0 / math.sqrt(case.head_dim)
            want = attention_cells_ref(q, k, v, c, scale)
            dc = Cells(*_on(device, c.pos, c.seq, c.q_pos, c.q_seq), c.swa, c.n_swa, c.causal)
            got = attention_triton(*_on(device, q, k, v), dc, scale, n_split=case.n_split)
            torch.testing.assert_close(
                got.cpu(), want, **TOL[q_dtype], msg=lambda m, c=case, d=q_dtype: f"{c} {d}: {m}"
            )


def check_store_kv(device: str, quick: bool = False) -> None:
    """Exact row copies (one rounding to the cache type, to nearest even as torch rounds)."""
    g = torch.Generator().manual_seed(0)
    for dst_dtype in DTYPES[:1] if quick else DTYPES:
        for src_dtype in (torch.float32, torch.float16):
            dst = torch.randn(64, 200, generator=g).to(dst_dtype)
            src = torch.randn(9, 200, generator=g).to(src_dtype)
            idx = torch.randperm(64, generator=g)[:9]
            want = dst.clone()
            store_kv_ref(want, src, idx)
            got, s, i = _on(device, dst, src, idx)
            store_kv_triton(got, s, i)
            if device == "cpu" and dst_dtype == torch.bfloat16 and src_dtype != dst_dtype:
                continue  # the interpreter rounds to bf16 toward zero (test_store_kv allows it)
            assert torch.equal(got.cpu(), want), (dst_dtype, src_dtype)


def check_kv_blocks(device: str, quick: bool = False) -> None:
    """Quantized caches: rows stored as blocks (the reference's bytes; IQ4_NL's fp16 scale within
    an ulp) and attention reading K and V blocks, mask and split keys, against the reference."""
    g = torch.Generator().manual_seed(0)
    types = [t for t in KV_TYPES.values() if t.quantized]
    for t in types[:1] if quick else types:
        src = torch.randn(9, 128, generator=g) * 3
        dst = torch.zeros(64, t.row_bytes(128), dtype=torch.uint8)
        idx = torch.randperm(64, generator=g)[:9]
        want = dst.clone()
        store_kv_ref(want, src, idx, t)
        got, s, i = _on(device, dst, src, idx)
        store_kv_triton(got, s, i, t)
        diff = (got.cpu().view(-1, t.block_bytes) != want.view(-1, t.block_bytes)).any(0)
        assert not diff[2:].any() and (t.name == "iq4_nl" or not diff.any()), t.name
    tol = test_kv_triton.TOL  # the interpreter tests' own
    for tk, tv in test_kv_triton.PAIRS[:1] if quick else test_kv_triton.PAIRS:
        shapes = [(2, 3, 8, 2, 128, 700, 1), (2, 3, 8, 2, 128, 700, 3), *test_kv_triton.SHAPES]
        for S, n_q, H, Hkv, D, n_kv, n_split in shapes[:1] if quick else shapes:
            q, k, v, a, b, gen = test_kv_triton.operands(tk, tv, S, n_q, H, Hkv, D, n_kv, seed=S + n_q + D)
            mask = torch.zeros(S, n_q, n_kv)
            mask[torch.rand(S, n_q, n_kv, generator=gen) < 0.3] = float("-inf")
            want = attention_ref(q, k, v, mask, 0.125, a, b)
            got = attention_triton(*_on(device, q, k, v, mask), 0.125, n_split=n_split, tk=a, tv=b)
            torch.testing.assert_close(got.cpu(), want, **tol, msg=lambda m, tk=tk, tv=tv: f"{tk} {tv}: {m}")
    for tk, tv in test_kv_triton.PAIRS[:1] if quick else test_kv_triton.PAIRS[:4]:
        case = test_kv_triton.SWA_CASE
        q, k, v, a, b, _ = test_kv_triton.operands(tk, tv, 2, 4, 4, 2, 64, 90, seed=7)
        c = make_cells(case, seed=3)
        want = attention_cells_ref(q, k, v, c, 0.125, a, b)
        dc = Cells(*_on(device, c.pos, c.seq, c.q_pos, c.q_seq), c.swa, c.n_swa, c.causal)
        got = attention_triton(*_on(device, q, k, v), dc, 0.125, tk=a, tv=b)
        torch.testing.assert_close(
            got.cpu(), want, **tol, msg=lambda m, tk=tk, tv=tv: f"cells {tk} {tv}: {m}"
        )


def check_dequant(device: str, quick: bool = False) -> None:
    """Every quantized type dequantized on the device, bit for bit as on the CPU."""
    for qtype in test_dequant.QUANT_TYPES[:1] if quick else test_dequant.QUANT_TYPES:
        raw = torch.from_numpy(np.array(test_dequant.random_bytes(qtype, (3, 512), seed=int(qtype))))
        want = dequantize(raw, int(qtype), (3, 512))
        got = dequantize(raw.to(device), int(qtype), (3, 512)).cpu()
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), qtype
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), qtype


def check_recurrent(device: str, quick: bool = False) -> None:
    """The scans of the recurrent models: Mamba's, Mamba-2's SSD, RWKV-6/7's, the short conv."""
    s, x, dt, A, B, C = test_ssm_scan.case(2, 19, 40, 16, 5)
    _close(ssm_scan_triton(*_on(device, s, x, dt, A, B, C), 4), ssm_scan_ref(s, x, dt, A, B, C, 4))
    if quick:
        return
    s, x, dt, A, B, C = test_ssd.case(2, 13, 4, 24, 2, 12, 5)
    _close(ssd_triton(*_on(device, s, x, dt, A, B, C), 3), ssd_ref(s, x, dt, A, B, C, 3))
    args = test_wkv6.make_inputs(2, 11, 3, 64, seed=1)
    _close(wkv6_triton(*_on(device, *args), n_states=2), wkv6_ref(*args, n_states=2))
    args = test_wkv7.make_inputs(2, 11, 3, 64, seed=2)
    _close(wkv7_triton(*_on(device, *args), n_states=2), wkv7_ref(*args, n_states=2))
    state, x, w, b = test_short_conv.case(3, 6, 16, 4, 7)
    _close(short_conv_triton(*_on(device, state, x, w, b), 6), short_conv_ref(state, x, w, b, 6))


def _close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)


CHECKS = [
    check_attention,
    check_attention_cells,
    check_store_kv,
    check_kv_blocks,
    check_dequant,
    check_recurrent,
]


def check_all(device: str) -> None:
    for check in CHECKS:
        check(device)
        print(f"{check.__name__}: ok on {device}")
