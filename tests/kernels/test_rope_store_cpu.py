"""kernels/rope_store_cpu: RoPE on Q/K rows and the K/V store in one compiled call, against its
specification op by op: the float32 pair formula's bits (rope.py's contract; apply_rope gives
them where torch vectorizes its complex multiply, and agrees to an ulp elsewhere), then
store_kv_ref. Native and portable C builds, NORM and NEOX, partial rotation, every cache type."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtool.kernels import cpu_lib, rope_store_cpu
from kvtool.kernels.store_kv import store_kv_ref
from kvtool.models.rope import RopeParams, Rotation, apply_rope

pytestmark = pytest.mark.skipif(cpu_lib.lib() is None, reason="no C compiler: the kernels are not built")


def pair_formula(x: torch.Tensor, rot: Rotation, p: RopeParams) -> torch.Tensor:
    """x [n, heads, hd] rotated: (a, b) -> (a c - b s, a s + b c), each op one float32 rounding."""
    assert rot.cs is not None
    half, out = p.n_rot // 2, x.clone()
    i = torch.arange(half)
    ia, ib = (i, i + half) if p.neox else (2 * i, 2 * i + 1)
    a, b = x[..., ia], x[..., ib]
    c, s = rot.cs[:, None, :, 0], rot.cs[:, None, :, 1]
    out[..., ia] = a * c - b * s
    out[..., ib] = a * s + b * c
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("neox", "n_rot", "hd"), [(False, 64, 64), (True, 32, 32), (True, 16, 48), (False, 8, 24)]
)
def test_the_same_bits_as_op_by_op(
    lib: ctypes.CDLL, dtype: torch.dtype, neox: bool, n_rot: int, hd: int
) -> None:
    gen = torch.Generator().manual_seed(n_rot * 7 + hd)
    n, H, Hkv = 5, 6, 2
    rope = RopeParams(n_rot=n_rot, base=10000.0, neox=neox)
    pos = torch.tensor([0, 3, 17, 250, 40000])
    rot = rope.rotation(pos)
    qkv = torch.randn(n, (H + 2 * Hkv) * hd, generator=gen) * 30  # values past half's range too
    qkv[0, 3] = 1e-6  # a half subnormal
    qkv[1, H * hd + 1] = 70000.0  # past the largest half
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=1)  # strided rows, as the models give them
    cache_k = torch.zeros(2, 16, Hkv * hd, dtype=dtype).view(32, -1)
    cache_v = torch.zeros(2, 16, Hkv * hd, dtype=dtype).view(32, -1)
    rows = torch.tensor([30, 2, 17, 5, 9])
    want_q = pair_formula(q.reshape(n, H, hd), rot, rope).reshape(n, -1)
    want_k = pair_formula(k.reshape(n, Hkv, hd), rot, rope).reshape(n, -1)
    torch.testing.assert_close(
        want_q, apply_rope(q.reshape(n, H, hd), rot, rope).reshape(n, -1), rtol=1e-6, atol=1e-5
    )
    want_kc, want_vc = cache_k.clone(), cache_v.clone()
    store_kv_ref(want_kc, want_k, rows)
    store_kv_ref(want_vc, v, rows)
    assert rope_store_cpu.applies(q, k, v, cache_k, cache_v)
    rope_store_cpu.rope_store(q, k, v, hd, rot.cs, n_rot, neox, cache_k, cache_v, rows, lib=lib)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(
        cache_k.view(torch.int16 if dtype != torch.float32 else torch.int32),
        want_kc.view(cache_k.dtype).view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
    assert torch.equal(cache_v, want_vc)


def test_without_rotation_it_only_stores() -> None:
    q, k, v = torch.randn(2, 8), torch.randn(2, 4), torch.randn(2, 4)
    q0, k0 = q.clone(), k.clone()
    cache_k, cache_v = torch.zeros(4, 4, dtype=torch.float16), torch.zeros(4, 4, dtype=torch.float16)
    rope_store_cpu.rope_store(q, k, v, 4, None, 4, False, cache_k, cache_v, torch.tensor([3, 0]))
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert torch.equal(cache_k[[3, 0]], k.half()) and torch.equal(cache_v[[3, 0]], v.half())


def test_what_it_does_not_take() -> None:
    q, k = torch.randn(2, 8), torch.randn(2, 4)
    cache = torch.zeros(4, 4)
    assert not rope_store_cpu.applies(q.double(), k, k, cache, cache)
    assert rope_store_cpu.applies(q, k, k, cache, cache.half())  # K and V types are independent
    assert not rope_store_cpu.applies(q, k, k, cache, cache.to(torch.uint8))  # blocks of which type?
    assert not rope_store_cpu.applies(q, k, k, torch.zeros(4, 6), cache)
    assert not rope_store_cpu.applies(q, k.t(), k, cache, cache)
    with pytest.raises(ValueError, match="bad call"):
        rope_store_cpu.rope_store(
            q, k, k, 4, torch.zeros(2, 3, 2), 6, False, cache, cache, torch.tensor([0, 1])
        )
