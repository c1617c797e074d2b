"""Weight-only 4-bit matmul on CPU: GGUF block formats repacked for torch's int4pack kernel.

torch's `_weight_int4pack_mm_for_cpu` computes x @ W.T with W[n, k] = (p[n, k] - 8) * s[g, n] + z[g, n]
for unsigned 4-bit p and one (scale, zero) pair per group g of 32 columns. Every GGUF format
whose sub-blocks are 32 elements of an affine x = a * u + c over unsigned integers u maps onto
it exactly: u of up to 4 bits is one such "plane" (z = c + 8a); u of 5 to 8 bits is two
planes, u = 16 * hi + lo, whose matmuls are summed (scales a and 16 a; see
`Int4Groups.planes` for where the offset goes).

`int4_groups` gives that exact decomposition (checked bit for bit against
`gguf.quants.dequantize` through `dequantize_groups_ref`); `pack` turns it into the kernel's
layout; `int4_linear` is the fast path (bfloat16 activations, float32 accumulation, scales and
zeros rounded to bfloat16 by the kernel's interface) and `int4_linear_ref` the specification.
Only bfloat16 activations take the kernel's vectorized path: float32 ones fall back to a
scalar loop an order of magnitude slower.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtool.kernels.dequant import (
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q8_0,
    _blocks,
    _half,
    _k_scales,
    _nibbles,
    _q5,
    _shifts,
)

GROUP = 32  # columns per (scale, zero) pair: every packable GGUF format has 32-element sub-blocks
_N_MULTIPLE = 16  # the kernel tiles output rows by 16


@dataclass(frozen=True)
class Int4Groups:
    """W[n, k] = a[n, g] * u[n, k] + c[n, g] with g = k // 32, u unsigned of `bits` bits."""

    u: torch.Tensor  # [N, K] uint8
    a: torch.Tensor  # [N, K / 32] float32
    c: torch.Tensor  # [N, K / 32] float32
    bits: int

    @property
    def n_planes(self) -> int:
        return 1 if self.bits <= 4 else 2

    def planes(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(p [N, K] uint8 in 0..15, scale [N, G], zero [N, G]) per 4-bit plane, low plane first."""
        if self.n_planes == 1:
            return [(self.u, self.a, self.c + 8.0 * self.a)]
        # Each plane's zero is kept small: the kernel takes zeros in bfloat16 (relative error
        # 2^-9 on every weight of the group), so a large zero would be a large systematic error.
        # hi (0 .. n_hi - 1) is shifted by o to sit around 8 and its plane needs no zero at all;
        # the low plane carries the offset: z = c + (8 + 16 * (8 - o)) * a.
        n_hi = 1 << (self.bits - 4)
        o = 8 - n_hi // 2
        lo, hi = self.u & 0x0F, (self.u >> 4) + o
        z0 = self.c + float(8 + 16 * (8 - o)) * self.a
        return [(lo, self.a, z0), (hi, 16.0 * self.a, torch.zeros_like(self.a))]


def _q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    d = _half(b, 0)  # x = d * (q - 8)
    return _nibbles(b[:, 2:]).flatten(1), d, -8.0 * d, 4


def _q4_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    return _nibbles(b[:, 4:]).flatten(1), _half(b, 0), _half(b, 2), 4  # x = d * q + m


def _q5_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    d = _half(b, 0)  # x = d * (q - 16)
    return _q5(b, 2), d, -16.0 * d, 5


def _q5_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    return _q5(b, 4), _half(b, 0), _half(b, 2), 5  # x = d * q + m


def _q8_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    d = _half(b, 0)  # x = d * q for int8 q = u - 128
    u = (b[:, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return u, d, -128.0 * d, 8


def _k_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32-element sub-block of a Q4_K/Q5_K super-block: a = d * scale, c = -dmin * min, [n * 8, 1]."""
    sc, mn = _k_scales(b, 4)  # [n, 8, 1]
    d, dmin = _half(b, 0).unsqueeze(-1), _half(b, 2).unsqueeze(-1)
    return (d * sc).reshape(-1, 1), (-(dmin * mn)).reshape(-1, 1)


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    u = _nibbles(b[:, 16:].view(-1, 4, 32)).reshape(-1, 32)  # sub-block order, as in dequant
    a, c = _k_affine(b)
    return u, a, c, 4


def _q5_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    lo = _nibbles(b[:, 48:].view(-1, 4, 32)).view(-1, 8, 32)
    hi = (b[:, 16:48].unsqueeze(1) >> _shifts(b, *range(8)).view(1, 8, 1)) & 1
    a, c = _k_affine(b)
    return (lo | (hi << 4)).reshape(-1, 32), a, c, 5


# type id -> (bytes per block, groups of 32 per block, decomposition)
_FORMATS: dict[
    int, tuple[int, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]]
] = {
    Q4_0: (18, _q4_0),
    Q4_1: (20, _q4_1),
    Q5_0: (22, _q5_0),
    Q5_1: (24, _q5_1),
    Q8_0: (34, _q8_0),
    Q4_K: (144, _q4_k),
    Q5_K: (176, _q5_k),
}


def packable(qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether a 2-D weight of GGML type `qtype` and numpy shape (N, K) maps exactly onto int4pack."""
    return (
        int(qtype) in _FORMATS and len(shape) == 2 and shape[0] % _N_MULTIPLE == 0 and shape[1] % GROUP == 0
    )


def n_planes_of(qtype: int) -> int:
    """4-bit planes a packable type needs: 1 for 4-bit formats, 2 for 5- and 8-bit ones."""
    return 1 if int(qtype) in (Q4_0, Q4_1, Q4_K) else 2


def int4_groups(raw: torch.Tensor, qtype: int, shape: tuple[int, int]) -> Int4Groups:
    """The exact affine decomposition of a GGUF tensor's raw bytes (see the module docstring)."""
    if not packable(qtype, shape):
        raise ValueError(f"type id {qtype} with shape {tuple(shape)} does not map onto int4pack")
    type_size, fn = _FORMATS[int(qtype)]
    n, k = shape
    u, a, c, bits = fn(_blocks(raw.reshape(-1).view(torch.uint8), type_size))
    return Int4Groups(u.reshape(n, k), a.reshape(n, k // GROUP), c.reshape(n, k // GROUP), bits)


def dequantize_groups_ref(g: Int4Groups) -> torch.Tensor:
    """float32 W [N, K] from the planes: sum_j (p_j - 8) * s_j + sum_j z_j (the integer parts
    first: they are exact in float32, so W rounds once more than the zeros do)."""
    n, k = g.u.shape
    w = torch.zeros(n, k // GROUP, GROUP)
    zero = torch.zeros(n, k // GROUP, 1)
    for p, s, z in g.planes():
        w += (p.float() - 8.0).view(n, -1, GROUP) * s.unsqueeze(-1)
        zero += z.unsqueeze(-1)
    return (w + zero).view(n, k)


@dataclass(frozen=True)
class Int4Packed:
    """A weight in torch's int4pack layout: per plane, the packed nibbles and bf16 scales/zeros."""

    weights: tuple[torch.Tensor, ...]  # [N, K / 2] uint8 each
    scales_zeros: tuple[torch.Tensor, ...]  # [K / 32, N, 2] bfloat16 each
    shape: tuple[int, int]  # (N, K)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.weights, *self.scales_zeros))


def _nibbles_layout(q: torch.Tensor, block_n: int) -> torch.Tensor:
    """The CPU kernel's weight layout, as observed: per block of `block_n` rows, byte [k, j] holds
    row j's nibble k (low) and row j + block_n/2's (high), k-major; viewed as [N, K / 2]."""
    n, k = q.shape
    b = q.view(n // block_n, 2, block_n // 2, k)
    return (b[:, 0] | (b[:, 1] << 4)).transpose(1, 2).contiguous().view(n, k // 2)


@functools.cache
def _layout_block() -> int | None:
    """The row block of torch's packed layout on this CPU (it differs by ISA), found by packing
    a probe both ways; None if neither known layout matches (then torch's converter is used)."""
    q = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    want = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    for block in (32, 64):
        got = _nibbles_layout(q, block)
        if got.shape == want.shape and torch.equal(got, want):
            return block
    return None


def _pack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """torch's packed layout of 4-bit p [N, K] (uint8): built directly when the layout is known
    (the converter wants int32 input: 4 bytes per weight and two more passes at load)."""
    block = _layout_block()
    if block is not None and p.shape[0] % block == 0:
        return _nibbles_layout(p, block)
    return torch._convert_weight_to_int4pack_for_cpu(p.to(torch.int32), 1)


def pack(*gs: Int4Groups) -> Int4Packed:
    """The kernel's layout for `gs` stacked along N (one matmul for several weights over the same
    input, e.g. Q, K and V); all must have the same number of planes. Scales and zeros are
    rounded to bfloat16, as the kernel's interface takes them."""
    if len({g.n_planes for g in gs}) != 1:
        raise ValueError("weights packed together need the same number of planes")
    ws, szs = [], []
    for planes in zip(*(g.planes() for g in gs), strict=True):
        p = torch.cat([pl[0] for pl in planes]) if len(planes) > 1 else planes[0][0]
        s = torch.cat([pl[1] for pl in planes]) if len(planes) > 1 else planes[0][1]
        z = torch.cat([pl[2] for pl in planes]) if len(planes) > 1 else planes[0][2]
        ws.append(_pack_nibbles(p))
        szs.append(torch.stack((s.t(), z.t()), dim=-1).to(torch.bfloat16).contiguous())
    return Int4Packed(tuple(ws), tuple(szs), (sum(g.u.shape[0] for g in gs), gs[0].u.shape[1]))


def int4_linear(x: torch.Tensor, w: Int4Packed) -> torch.Tensor:
    """x [M, K] (any float dtype) @ W.T -> [M, N] float32; activations go through bfloat16."""
    xb = x.to(torch.bfloat16)
    out = torch._weight_int4pack_mm_for_cpu(xb, w.weights[0], GROUP, w.scales_zeros[0]).float()
    for p, sz in zip(w.weights[1:], w.scales_zeros[1:], strict=True):
        out += torch._weight_int4pack_mm_for_cpu(xb, p, GROUP, sz).float()
    return out


def int4_linear_ref(x: torch.Tensor, g: Int4Groups) -> torch.Tensor:
    """The specification of `int4_linear` in float32: bf16-rounded activations, scales and zeros."""
    w = torch.zeros(g.u.shape)
    for p, s, z in g.planes():
        s, z = s.bfloat16().float(), z.bfloat16().float()
        n, k = p.shape
        w += ((p.float() - 8.0).view(n, -1, GROUP) * s.unsqueeze(-1) + z.unsqueeze(-1)).view(n, k)
    return x.to(torch.bfloat16).float() @ w.t()
