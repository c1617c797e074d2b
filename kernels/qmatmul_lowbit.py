"""The specification of qmatmul_lowbit.c: Q2_K, Q3_K, IQ4_XS and IQ4_NL weights times activations
quantized as llama.cpp's CPU backend quantizes them for each format (ggml's vec_dot_type).

Q2_K, Q3_K and IQ4_XS take Q8_K activations (`quantize_q8_k_ref`, ggml's quantize_row_q8_K),
IQ4_NL takes Q8_0 with its scale kept as a half (`quantize_q8_0_ref`, ggml's quantize_row_q8_0).
The compiled kernel is called through kernels/qmatmul.py's QWeight like every GGUF format; it
computes the integer sums of these quantized rows with the exactly dequantized weights, scaled
per block, so it equals `qmatmul_lowbit_ref` up to the order of float additions.
"""

from __future__ import annotations

import torch

from kvtool.kernels.dequant import IQ4_NL, QK_K, dequantize
from kvtool.kernels.qmatmul import LOWBIT_TYPES as TYPES  # noqa: F401 (the formats specified here)


def _round_half_even(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # torch rounds halves to even, as ggml's nearest_int and nearbyintf


def quantize_q8_k_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, K] -> (q [n, K/256, 256] as float, d [n, K/256, 1], bsums [n, K/256, 16]) as ggml's
    quantize_row_q8_K: per 256 the element of largest magnitude (the first of equals) sets
    iscale = -127 / max, q = min(127, round(iscale * x)), d = 1 / iscale; all-zero blocks are 0."""
    xb = x.float().reshape(x.shape[0], -1, QK_K)
    first = xb.abs().argmax(-1, keepdim=True)  # argmax returns the first of equal maxima
    mx = xb.gather(-1, first)
    iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
    q = _round_half_even(iscale * xb).clamp(max=127.0)
    d = torch.where(mx != 0, 1.0 / iscale, torch.zeros_like(mx))
    return q, d, q.reshape(*q.shape[:2], 16, 16).sum(-1)


def quantize_q8_0_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, K] -> (q [n, K/32, 32] as float, d [n, K/32, 1]) as ggml's quantize_row_q8_0 on x86:
    d = max|x| / 127 rounded to a half, q = round(x * (127 / max|x|)) to nearest even."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    return _round_half_even(xb * inv), (amax / 127.0).half().float()


def quantize_ref(x: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [n, K] as the format's activation quantization gives it back (q * d), float32."""
    if int(qtype) == IQ4_NL:
        q, d = quantize_q8_0_ref(x)
    else:
        q, d, _ = quantize_q8_k_ref(x)
    return (q * d).reshape(x.shape)


def qmatmul_lowbit_ref(x: torch.Tensor, w: torch.Tensor, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """The specification: quantized activations times the exactly dequantized weights, in float64."""
    xq = quantize_ref(x, qtype).double()
    return (xq @ dequantize(w, qtype, shape).double().T).float()
