"""K/V cache types (llama.cpp's -ctk/-ctv) and their GGUF block formats, in torch (any device).

A float cache (f32, f16, bf16) stores rows in that dtype. A quantized cache stores each row as
the GGUF blocks of its type, `block` values in `block_bytes` bytes (q8_0: 32 values in 34), as
uint8. `quantize` is what llama.cpp's set_rows runs when it stores K/V rows on the CPU (the
type's from_float), bit for bit (every float operation the same, in the same order, each
rounded to float32): ggml's quantize_row_*_ref, except q8_0, whose from_float is the SIMD
quantizer of the x86 build (scale 127 / max|x|, ties to even); `dequantize` is
kernels/dequant.py (gguf.quants' bits).

ggml's CPU flash attention does not dequantize K: it quantizes each query row to K's
`vec_dot` type (q8_0, or q8_1 for the affine q4_1/q5_1) and takes integer dot products block by
block. `quantize_q` gives that query as the dot product sees it (its values d * q), with the
x86 build's rounding (scale 127 / max|x|, ties to even), so a float dot product with the
dequantized K has the integer path's value up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dequant import IQ4_VALUES
from .dequant import dequantize as _dequantize

QK = 32  # values per block of every quantized K/V type


@dataclass(frozen=True)
class KVType:
    """One cache type: its llama.cpp name, ggml type id and storage."""

    name: str  # llama.cpp's: f32, f16, bf16, q8_0, ...
    ggml: int  # ggml type id (gguf.GGMLQuantizationType)
    block: int  # values per block (1: a float type)
    block_bytes: int
    dtype: torch.dtype  # what the cache tensor holds: the float type, or uint8 blocks
    vec_dot: str | None = None  # quantized K: the type a query is quantized to (ggml's vec_dot_type)

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def divides(self, n: int) -> bool:
        """Whether rows of `n` values are whole blocks."""
        return n % self.block == 0

    def row_bytes(self, n: int) -> int:
        """Bytes of a row of `n` values (whole blocks)."""
        if not self.divides(n):
            raise ValueError(f"{self.name} with block size {self.block} does not divide {n}")
        return n // self.block * self.block_bytes

    def width(self, n: int) -> int:
        """Elements of `dtype` a row of `n` values takes (bytes for a quantized type)."""
        return self.row_bytes(n) if self.quantized else n

    def values(self, width: int) -> int:
        """Values a stored row of `width` elements holds (`width`'s inverse)."""
        return width // self.block_bytes * self.block if self.quantized else width


KV_TYPES: dict[str, KVType] = {
    t.name: t
    for t in (
        KVType("f32", 0, 1, 4, torch.float32),
        KVType("f16", 1, 1, 2, torch.float16),
        KVType("bf16", 30, 1, 2, torch.bfloat16),
        KVType("q8_0", 8, QK, 34, torch.uint8, "q8_0"),
        KVType("q4_0", 2, QK, 18, torch.uint8, "q8_0"),
        KVType("q4_1", 3, QK, 20, torch.uint8, "q8_1"),
        KVType("q5_0", 6, QK, 22, torch.uint8, "q8_0"),
        KVType("q5_1", 7, QK, 24, torch.uint8, "q8_1"),
        KVType("iq4_nl", 20, QK, 18, torch.uint8, "q8_0"),
    )
}


# each type's id in the compiled CPU kernels (kernels/kv_blocks.h)
C_IDS = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5, "q5_0": 6, "q5_1": 7, "iq4_nl": 8}


def kv_type(name: str) -> KVType:
    """The type named `name`; ValueError for an unknown one."""
    t = KV_TYPES.get(name)
    if t is None:
        raise ValueError(f"unsupported KV cache type '{name}' ({', '.join(KV_TYPES)})")
    return t


# -- ggml's reference quantizers ------------------------------------------------------------------
def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> the fp16 bits, [n, 2] bytes (round to nearest even, as GGML_FP32_TO_FP16)."""
    return x.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _trunc_u8(x: torch.Tensor, hi: int) -> torch.Tensor:
    """MIN(hi, (int8_t) x) for the non-negative x ggml's quantizers produce."""
    return x.trunc().clamp(0, hi).to(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 32] values below 16 -> [n, 16] bytes: element j in the low nibble, j + 16 in the high."""
    return q[:, :16] | (q[:, 16:] << 4)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """[n, 32] 5-bit values -> [n, 4] bytes of their 5th bits, bit j for element j (little endian)."""
    bits = ((q >> 4) & 1).view(-1, 4, 8).to(torch.int32)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=q.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def _signed_max(x: torch.Tensor) -> torch.Tensor:
    """[n, 32] -> [n, 1]: the value of largest magnitude, the first one on a tie (ggml's loop)."""
    return x.gather(1, x.abs().argmax(dim=1, keepdim=True))


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_max(x) / -8
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = _trunc_u8(x * inv + 8.5, 15)
    return torch.cat([_half_bytes(d), _pack_nibbles(q)], dim=1)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_max(x) / -16
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = _trunc_u8(x * inv + 16.5, 31)
    return torch.cat([_half_bytes(d), _pack_high_bits(q), _pack_nibbles(q & 15)], dim=1)


def _affine(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lo = x.min(dim=1, keepdim=True).values
    d = (x.max(dim=1, keepdim=True).values - lo) / levels
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return d, lo, (x - lo) * inv + 0.5


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, y = _affine(x, 15)
    return torch.cat([_half_bytes(d), _half_bytes(lo), _pack_nibbles(_trunc_u8(y, 15))], dim=1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    d, lo, y = _affine(x, 31)
    q = _trunc_u8(y, 31)  # ggml's (uint8_t) cast: y stays below 32
    return torch.cat([_half_bytes(d), _half_bytes(lo), _pack_high_bits(q), _pack_nibbles(q & 15)], dim=1)


def _q8_x86(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's x86 quantize_row_q8_0 of blocks x [n, 32]: (d [n, 1], the integers as float32);
    scale 127 / max|x| (not 1 / d as the _ref quantizer), ties to even (not away from zero)."""
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    return amax / 127, torch.round(x * inv)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    # llama.cpp's CPU set_rows stores with the type's from_float, for q8_0 the SIMD quantizer
    # (the other types' from_float is their _ref)
    d, ints = _q8_x86(x)
    return torch.cat([_half_bytes(d), ints.to(torch.int8).view(torch.uint8)], dim=1)


def _iq4_nl(x: torch.Tensor) -> torch.Tensor:
    """quantize_row_iq4_nl_ref: indices for the scale max / -127, then the scale that fits them
    best in least squares (weights x^2); an all-zero block gets scale 0 and index 0."""
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=x.device)
    mx = _signed_max(x)
    inv = 1.0 / (mx / values[0])
    idx = nearest_iq4_nl(x * inv, values)
    q = values[idx]
    wq = x * x * q
    sumqx, sumq2 = torch.zeros_like(mx), torch.zeros_like(mx)
    for j in range(QK):  # in order, in float32, as ggml sums
        sumqx += wq[:, j : j + 1] * x[:, j : j + 1]
        sumq2 += wq[:, j : j + 1] * q[:, j : j + 1]
    d = torch.where(sumq2 > 0, sumqx / sumq2, torch.zeros_like(sumqx))
    empty = x.abs().amax(dim=1, keepdim=True) < 1e-15  # ggml's GROUP_MAX_EPS
    d = torch.where(empty, torch.zeros_like(d), d)
    idx = torch.where(empty, torch.zeros_like(idx), idx).to(torch.uint8)
    return torch.cat([_half_bytes(d), _pack_nibbles(idx)], dim=1)


def nearest_iq4_nl(a: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8 over the 16 IQ4_NL values: the nearest, the upper one on a tie."""
    mu = torch.searchsorted(values, a.contiguous(), right=True).clamp(1, 15)
    lo, hi = values[mu - 1], values[mu]
    return torch.where(a - lo < hi - a, mu - 1, mu)


_QUANTIZE = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "iq4_nl": _iq4_nl}


def quantize(x: torch.Tensor, t: KVType) -> torch.Tensor:
    """Rows x [..., n] (float) as a cache of type `t` stores them: [..., n] of a float type, or
    [..., row_bytes(n)] uint8 blocks (ggml's reference quantizer, bit for bit)."""
    if not t.quantized:
        return x.to(t.dtype)
    n = x.shape[-1]
    blocks = x.reshape(-1, t.block).float()
    return _QUANTIZE[t.name](blocks).reshape(*x.shape[:-1], t.row_bytes(n))


def dequantize(raw: torch.Tensor, t: KVType, n: int | None = None) -> torch.Tensor:
    """Stored rows [..., width] of type `t` (a row holds `n` values, by default all its width
    can) as float32 [..., n]."""
    if not t.quantized:
        return raw.float()
    lead = tuple(raw.shape[:-1])
    n = t.values(raw.shape[-1]) if n is None else n
    return _dequantize(raw.contiguous(), t.ggml, (*lead, n))


def cache_type(cache: torch.Tensor, t: KVType | None) -> KVType | None:
    """The type of a cache tensor: `t` where given (a quantized cache's), else the float type of
    its dtype; None where they do not agree (uint8 blocks without a type, a float64 tensor)."""
    if t is not None:
        return t if t.dtype == cache.dtype else None
    return next((f for f in KV_TYPES.values() if not f.quantized and f.dtype == cache.dtype), None)


def quantize_q(q: torch.Tensor, vec_dot: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A query row [..., n] as ggml's CPU flash attention multiplies it with a quantized K: its
    blocks of 32 quantized to q8_0 or q8_1 (x86: scale 127 / max|x|, ties to even). Returns its
    values d * q (float32, d rounded to fp16) and, for q8_1, each block's `s` [..., n / 32]:
    fp16(d * sum(q)), through which an affine K's minimum enters the dot product."""
    if vec_dot not in ("q8_0", "q8_1"):
        raise ValueError(f"no query quantization for '{vec_dot}'")
    d, ints = _q8_x86(q.float().reshape(-1, QK))
    values = (ints * d.to(torch.float16).float()).reshape(q.shape)
    if vec_dot == "q8_0":
        return values, None
    s = (d * ints.sum(dim=1, keepdim=True)).to(torch.float16).float()
    return values, s.reshape(*q.shape[:-1], -1)


def split_affine(raw: torch.Tensor, t: KVType) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored rows of an affine type (q4_1, q5_1: x = d * q + m) as d * q [..., n] and the
    blocks' m [..., n / 32], float32: a query quantized to q8_1 meets m through its `s`."""
    blocks = raw.reshape(*raw.shape[:-1], -1, t.block_bytes)
    mins = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    no_min = blocks.clone()
    no_min[..., 2:4] = 0  # x * d + 0.0 is x * d
    return dequantize(no_min.reshape(raw.shape), t), mins


def blocks_finite(raw: torch.Tensor, t: KVType) -> bool:
    """Whether every block's scale (and minimum) is a finite number: the only fields of a block
    that can hold NaN or infinity (a float type: every value)."""
    if not t.quantized:
        return bool(raw.isfinite().all())
    b = raw.reshape(-1, t.block_bytes)
    n_half = 2 if t.vec_dot == "q8_1" else 1  # the affine types store d and m
    halves = b[:, : 2 * n_half].contiguous().view(torch.float16)
    return bool(halves.isfinite().all())
