"""Dequantization of GGML tensor types to float, in torch (runs on any device).

`raw` is the tensor's bytes (uint8, or any dtype, viewed as bytes); `shape` is in numpy order
(reversed ggml ne), so the last dimension is the one that blocks run along. Every function
below is vectorized over blocks and reproduces `gguf.quants.dequantize` bit for bit: the float
operations are the same ones, in the same order, each rounded to float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# GGML type ids (ggml.h / gguf.GGMLQuantizationType): kernels import only torch.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS, BF16 = 20, 23, 30

# ggml's type names by id, for error messages ("-" marks unused ids); one string keeps it short.
_NAMES = (  # noqa: SIM905
    "F32 F16 Q4_0 Q4_1 - - Q5_0 Q5_1 Q8_0 Q8_1 Q2_K Q3_K Q4_K Q5_K Q6_K Q8_K IQ2_XXS IQ2_XS "
    "IQ3_XXS IQ1_S IQ4_NL IQ3_S IQ2_S IQ4_XS I8 I16 I32 I64 F64 IQ1_M BF16 - - - TQ1_0 TQ2_0 "
    "- - - MXFP4"
).split()

QK_K = 256  # elements in a K-quant super-block


def _type_name(qtype: int) -> str:
    name = _NAMES[qtype] if 0 <= qtype < len(_NAMES) else "-"
    return f"{name} ({qtype})" if name != "-" else f"id {qtype}"


def _blocks(raw: torch.Tensor, type_size: int) -> torch.Tensor:
    return raw.view(-1, type_size)  # [n_blocks, type_size]


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of every block, as float32 [n_blocks, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _shifts(ref: torch.Tensor, *bits: int) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8, device=ref.device)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2, k]: low nibbles, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8 * k] bits, little-endian: bit j of the result is bit j % 8 of byte j // 8."""
    return ((qh.unsqueeze(-1) >> _shifts(qh, *range(8))) & 1).flatten(1)


def _centered(q: torch.Tensor, offset: int) -> torch.Tensor:
    """float(q - offset) for a fresh uint8 q below 128, subtracting in int8 to save a float pass."""
    return q.view(torch.int8).sub_(offset).float()


def _f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float32)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.view(torch.float16).float()


def _bf16(raw: torch.Tensor) -> torch.Tensor:
    # bf16 is the top half of a float32: widening is a 16-bit shift, NaN payloads included.
    return raw.view(torch.bfloat16).float()


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    # 18 bytes: fp16 d, 16 bytes of 4-bit q (low nibbles: elements 0-15, high: 16-31); x = d * (q - 8)
    b = _blocks(raw, 18)
    return _centered(_nibbles(b[:, 2:]).flatten(1), 8).mul_(_half(b, 0))


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    # 20 bytes: fp16 d, fp16 m, 16 bytes of 4-bit q (as Q4_0); x = d * q + m
    b = _blocks(raw, 20)
    q = _nibbles(b[:, 4:]).flatten(1).float()
    return q.mul_(_half(b, 0)).add_(_half(b, 2))


def _q5(b: torch.Tensor, at: int) -> torch.Tensor:
    """5-bit q of Q5_0/Q5_1: 4 bytes of high bits (bit j for element j) at `at`, then 16 bytes of nibbles."""
    return _nibbles(b[:, at + 4 :]).flatten(1) | (_bits(b[:, at : at + 4]) << 4)


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    # 22 bytes: fp16 d, uint32 qh (5th bits), 16 bytes of low nibbles; x = d * (q - 16)
    b = _blocks(raw, 22)
    return _centered(_q5(b, 2), 16).mul_(_half(b, 0))


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    # 24 bytes: fp16 d, fp16 m, uint32 qh (5th bits), 16 bytes of low nibbles; x = d * q + m
    b = _blocks(raw, 24)
    return _q5(b, 4).float().mul_(_half(b, 0)).add_(_half(b, 2))


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    # 34 bytes: fp16 d, 32 int8 q; x = d * q
    b = _blocks(raw, 34)
    return b[:, 2:].view(torch.int8).float().mul_(_half(b, 0))


def _k_scales(b: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and 8 six-bit mins packed in 12 bytes at `at` (Q4_K/Q5_K), each [n, 8, 1].

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; the top 2 bits of those
    bytes are the high bits of scales/mins 4-7, whose low 4 bits are the nibbles of bytes 8-11.
    """
    s = b[:, at : at + 12].view(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _affine_k(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = (d * scale) * q - dmin * min per 32-element sub-block; q is [n, 8, 32] float."""
    sc, mn = _k_scales(b, 4)
    d, dmin = _half(b, 0).unsqueeze(-1), _half(b, 2).unsqueeze(-1)
    return q.mul_(d * sc).sub_(dmin * mn).flatten(1)


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    # 144 bytes / 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales+mins, 128 bytes of 4-bit q
    # (byte group k of 32 holds sub-block 2k in its low nibbles, 2k+1 in its high nibbles)
    b = _blocks(raw, 144)
    q = _nibbles(b[:, 16:].view(-1, 4, 32)).view(-1, 8, 32).float()
    return _affine_k(b, q)


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    # 176 bytes / 256: fp16 d, fp16 dmin, 12 bytes of scales+mins, 32 bytes qh, 128 bytes of nibbles
    # (as Q4_K; bit i of qh[l] is the 5th bit of element l of sub-block i)
    b = _blocks(raw, 176)
    lo = _nibbles(b[:, 48:].view(-1, 4, 32)).view(-1, 8, 32)
    hi = (b[:, 16:48].unsqueeze(1) >> _shifts(b, *range(8)).view(1, 8, 1)) & 1
    return _affine_k(b, (lo | (hi << 4)).float())


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    # 210 bytes / 256: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales, fp16 d;
    # x = d * scale[16-element group] * (q - 32)
    b = _blocks(raw, 210)
    # each half of 128 elements: ql bytes 0-31 low/high nibbles -> sub-blocks 0/2, 32-63 -> 1/3
    ql = _nibbles(b[:, :128].view(-1, 2, 64)).view(-1, 8, 32)
    # qh bits 2k..2k+1 of byte l (of 32) -> sub-block k of the half
    qh = (b[:, 128:192].view(-1, 2, 1, 32) >> _shifts(b, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3
    q = _centered(ql | (qh.view(-1, 8, 32) << 4), 32).view(-1, QK_K // 16, 16)
    scale = b[:, 192:208].view(torch.int8).float()
    return q.mul_((_half(b, 208) * scale).unsqueeze(-1)).flatten(1)


def _q2_k(raw: torch.Tensor) -> torch.Tensor:
    # 84 bytes / 256: 16 scale bytes (low nibble scale, high nibble min per 16 elements), 64 bytes
    # of 2-bit q, fp16 d, fp16 dmin; x = (d * scale) * q - dmin * min. Byte l of each 32-byte
    # half holds element l of its 4 sub-blocks of 32 at bits 0-1, 2-3, 4-5, 6-7.
    b = _blocks(raw, 84)
    sc = b[:, :16].unsqueeze(-1)  # [n, 16, 1]
    dl = _half(b, 80).unsqueeze(-1) * (sc & 0xF).float()
    ml = _half(b, 82).unsqueeze(-1) * (sc >> 4).float()
    q = (b[:, 16:80].view(-1, 2, 1, 32) >> _shifts(b, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3
    return q.view(-1, 16, 16).float().mul_(dl).sub_(ml).flatten(1)


def _q3_k(raw: torch.Tensor) -> torch.Tensor:
    # 110 bytes / 256: 32 bytes hmask, 64 bytes of 2-bit q (as Q2_K), 12 bytes of 6-bit scales,
    # fp16 d; x = d * (scale - 32) * (q - 4 * (1 - hbit)) per 16 elements. Bit j of hmask byte l
    # is the high bit of element l of sub-block j of 32. Scale j's low 4 bits are the low (j < 8)
    # or high nibble of byte j % 8, its top 2 bits bits 2 * (j // 4) of byte 8 + j % 4.
    b = _blocks(raw, 110)
    s = b[:, 96:108]
    lo = (s[:, :8].unsqueeze(1) >> _shifts(b, 0, 4).view(1, 2, 1)).reshape(-1, 16) & 0xF
    hi = (s[:, 8:].unsqueeze(1) >> _shifts(b, 0, 2, 4, 6).view(1, 4, 1)).reshape(-1, 16) & 3
    scale = (lo | (hi << 4)).view(torch.int8).sub_(32).float()
    dl = (_half(b, 108) * scale).unsqueeze(-1)  # [n, 16, 1]
    ql = (b[:, 32:96].view(-1, 2, 1, 32) >> _shifts(b, 0, 2, 4, 6).view(1, 1, 4, 1)) & 3
    qh = (b[:, :32].view(-1, 1, 32) >> _shifts(b, *range(8)).view(1, 8, 1)) & 1
    q = ql.view(-1, 16, 16).view(torch.int8) - ((qh.view(-1, 16, 16) ^ 1) << 2).view(torch.int8)
    return q.float().mul_(dl).flatten(1)


# the 16 values of the non-linear 4-bit formats (ggml's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_values(q: torch.Tensor) -> torch.Tensor:
    """The float value of each 4-bit index of q (uint8 0..15)."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32, device=q.device)[q.long()]


def _iq4_nl(raw: torch.Tensor) -> torch.Tensor:
    # 18 bytes / 32: fp16 d, 16 bytes of 4-bit indices (low nibbles: elements 0-15, high: 16-31);
    # x = d * IQ4_VALUES[q]
    b = _blocks(raw, 18)
    return _iq4_values(_nibbles(b[:, 2:]).flatten(1)).mul_(_half(b, 0))


def _iq4_xs(raw: torch.Tensor) -> torch.Tensor:
    # 136 bytes / 256: fp16 d, uint16 of the scales' high 2 bits (2 per sub-block of 32), 4 bytes
    # of their low nibbles, 128 bytes of 4-bit indices (16 per sub-block, as IQ4_NL);
    # x = d * (scale - 32) * IQ4_VALUES[q]
    b = _blocks(raw, 136)
    lo = _nibbles(b[:, 4:8]).transpose(1, 2).reshape(-1, 8)  # sub-block j: nibble j % 2 of byte j // 2
    hi = (_bits(b[:, 2:4]).view(-1, 8, 2) * _shifts(b, 1, 2)).sum(-1, dtype=torch.uint8)
    scale = (lo | (hi << 4)).view(torch.int8).sub_(32).float()
    dl = (_half(b, 0) * scale).unsqueeze(-1)  # [n, 8, 1]
    q = _nibbles(b[:, 8:].view(-1, 8, 16)).view(-1, 8, 32)
    return _iq4_values(q).mul_(dl).flatten(1)


# type id -> (elements per block, bytes per block, dequantize)
_DEQUANT: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    F32: (1, 4, _f32),
    F16: (1, 2, _f16),
    BF16: (1, 2, _bf16),
    Q4_0: (32, 18, _q4_0),
    Q4_1: (32, 20, _q4_1),
    Q5_0: (32, 22, _q5_0),
    Q5_1: (32, 24, _q5_1),
    Q8_0: (32, 34, _q8_0),
    Q2_K: (QK_K, 84, _q2_k),
    Q3_K: (QK_K, 110, _q3_k),
    Q4_K: (QK_K, 144, _q4_k),
    Q5_K: (QK_K, 176, _q5_k),
    Q6_K: (QK_K, 210, _q6_k),
    IQ4_NL: (32, 18, _iq4_nl),
    IQ4_XS: (QK_K, 136, _iq4_xs),
}


def supported_types() -> set[int]:
    """GGML type ids that `dequantize` handles."""
    return set(_DEQUANT)


def dequantize(raw: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 tensor of `shape` from the raw bytes of a tensor of GGML type `qtype`.

    F32 data comes back as a view of `raw` (no copy); every other type in a new tensor on
    `raw`'s device. Raises ValueError for an unsupported type or a size that does not match.
    """
    entry = _DEQUANT.get(int(qtype))
    if entry is None:
        raise ValueError(f"unsupported tensor type {_type_name(int(qtype))}")
    block_size, type_size, fn = entry
    raw = raw.reshape(-1).view(torch.uint8)  # also takes F32/F16 data already typed by the reader
    n_rows = 1
    for dim in shape[:-1]:
        n_rows *= dim
    row = shape[-1] if shape else 1
    if row % block_size or raw.numel() != n_rows * (row // block_size) * type_size:
        raise ValueError(
            f"{raw.numel()} bytes do not hold a {_type_name(int(qtype))} tensor of shape {tuple(shape)}"
        )
    return fn(raw).reshape(shape)
