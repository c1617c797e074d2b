"""Attention over a KV cache on the CPU, compiled (attention_cpu.c via cpu_lib).

The contract of `attention_ref` (kernels/attention_ref.py, its specification): q [S, n_q, H, D],
k/v [S, n_kv, Hkv, D(v)] in their cache types, each its own (f32, f16, bf16, or a quantized
type's blocks as bytes), at any strides with a contiguous last dimension, an additive mask
[S, n_q, n_kv] (0 / -inf); a row that sees no key gives zeros. Keys the mask hides are not read,
so padding cells cost nothing. Over a quantized K the query is quantized as llama.cpp's CPU flash
attention quantizes it and each key is an integer dot product per block; a quantized V is
dequantized block by block as it is added: the cache is never converted as a whole. For decode
(a few rows per stream) this replaces torch's SDPA, whose fixed cost per call exceeds the work;
over a quantized cache it takes every row count (prompts too), as llama.cpp does.
"""

from __future__ import annotations

import ctypes

import torch

from kvtool.kernels import cpu_lib
from kvtool.kernels.kv_quant import C_IDS, KVType, cache_type

MAX_ROWS = 16  # query rows per stream up to which the compiled kernel is used (float caches)


def _typed(lib: ctypes.CDLL) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    f = lib.kva_attention
    if f.argtypes is None:
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        f.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, c_int, c_int]
        f.argtypes += [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_float]
        f.restype = ctypes.c_int
    return f


def applies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tk: KVType | None = None, tv: KVType | None = None
) -> bool:
    """Whether `attention_cpu` takes these operands (tk/tv: a quantized cache's types)."""
    kt, vt = cache_type(k, tk), cache_type(v, tv)
    if kt is None or vt is None:
        return False
    rows_ok = q.shape[1] <= MAX_ROWS or kt.quantized or vt.quantized
    return (
        q.device.type == "cpu"
        and rows_ok
        and q.dtype == torch.float32
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
    `attention_ref`'s softcap is its specification)."""
    lib = cpu_lib.lib()
    kt, vt = cache_type(k, tk), cache_type(v, tv)
    assert lib is not None and kt is not None and vt is not None
    S, n_q, H, D = q.shape
    n_kv, Hkv = k.shape[1], k.shape[2]
    Dv = vt.values(v.shape[3])
    if mask.dtype != torch.float32 or not mask.is_contiguous():
        mask = mask.float().contiguous()
    if tuple(mask.shape) != (S, n_q, n_kv):
        raise ValueError(f"attention_cpu: mask {tuple(mask.shape)} for q {tuple(q.shape)}, n_kv {n_kv}")
    out = torch.empty(S, n_q, H, Dv)
    rc = _typed(lib)(
        q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), C_IDS[kt.name], C_IDS[vt.name],
        mask.data_ptr(), mask.stride(0), mask.stride(1),
        out.data_ptr(), S, n_q, H, Hkv, n_kv, D, Dv, scale, softcap,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"attention_cpu: bad call (q {tuple(q.shape)}, k {tuple(k.shape)})")
    return out
