"""Attention for a few query rows per stream on the CPU, compiled (attention_cpu.c via cpu_lib).

The contract of `attention_ref` (kernels/attention.py, its specification): q [S, n_q, H, D],
k/v [S, n_kv, Hkv, D(v)] in the cache's type (f32, f16, bf16) at any strides with a contiguous
last dimension, an additive mask [S, n_q, n_kv] (0 / -inf); a row that sees no key gives zeros.
Keys the mask hides are not read, so padding cells cost nothing. For decode (one or a few rows
per stream) this replaces torch's SDPA, whose fixed cost per call exceeds the work.
"""

from __future__ import annotations

import ctypes

import torch

from kvtool.kernels import cpu_lib
from kvtool.kernels.kv_quant import KVType

_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_ROWS = 16  # query rows per stream up to which the compiled kernel is used


def _typed(lib: ctypes.CDLL) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    f = lib.kva_attention_softcap
    if f.argtypes is None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        f.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, ctypes.c_int]
        f.argtypes += [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float]
        f.restype = ctypes.c_int
    return f


def applies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tk: KVType | None = None, tv: KVType | None = None
) -> bool:
    """Whether `attention_cpu` takes these operands."""
    return (
        not (tk is not None and tk.quantized)
        and not (tv is not None and tv.quantized)
        and q.device.type == "cpu"
        and q.shape[1] <= MAX_ROWS
        and q.dtype == torch.float32
        and k.dtype in _TYPES
        and v.dtype == k.dtype
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and cpu_lib.lib() is not None
    )


def attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    tk: KVType | None = None,
    tv: KVType | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v per stream (see the module docstring); needs `applies`.
    `softcap`: each score s becomes softcap * tanh(s / softcap) before the mask (Gemma 2;
    kernels/attention_softcap.py is its specification)."""
    lib = cpu_lib.lib()
    assert lib is not None
    S, n_q, H, D = q.shape
    n_kv, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    if mask.dtype != torch.float32 or not mask.is_contiguous():
        mask = mask.float().contiguous()
    if tuple(mask.shape) != (S, n_q, n_kv):
        raise ValueError(f"attention_cpu: mask {tuple(mask.shape)} for q {tuple(q.shape)}, n_kv {n_kv}")
    out = torch.empty(S, n_q, H, Dv)
    rc = _typed(lib)(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), _TYPES[k.dtype],
        mask.data_ptr(), mask.stride(0), mask.stride(1),
        out.data_ptr(), S, n_q, H, Hkv, n_kv, D, Dv, scale, softcap,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"attention_cpu: bad call (q {tuple(q.shape)}, k {tuple(k.shape)})")
    return out
