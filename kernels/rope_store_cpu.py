"""RoPE on a ubatch's Q/K rows and the K/V store into the layer's cache in one compiled call
(rope_store_cpu.c via cpu_lib).

Op by op this is `apply_rope` on Q and K (kvtool/models/rope.py), llama.cpp's Hadamard rotation
where the cache asks for it (`fwht`, kernels/hadamard.py), then `store_kv_ref` of K and V
(kernels/store_kv.py): those are the specification, and the compiled call gives their bits (the
pair formula without fused multiply-adds, round-to-nearest-even into f16/bf16, ggml's reference
quantizers into a quantized type). At one token the op-by-op path costs some forty microseconds
a layer in framework calls; this costs a few.
"""

from __future__ import annotations

import ctypes

import torch

from kvtool.kernels import cpu_lib
from kvtool.kernels.kv_quant import C_IDS, KVType, cache_type


def _rows(x: torch.Tensor) -> bool:  # float32 rows [n, width] with contiguous elements
    return x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and x.device.type == "cpu"


def applies(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tk: KVType | None = None,
    tv: KVType | None = None,
) -> bool:
    """Whether `rope_store` takes these: q/k/v float32 rows on the CPU, caches of a K/V type each
    (tk/tv: a quantized cache's types) as rows with contiguous elements, and the kernels loaded."""
    kt, vt = cache_type(k_cache, tk), cache_type(v_cache, tv)
    return (
        kt is not None
        and vt is not None
        and _rows(q)
        and _rows(k)
        and _rows(v)
        and k_cache.dim() == 2
        and v_cache.dim() == 2
        and k_cache.stride(1) == 1
        and v_cache.stride(1) == 1
        and k_cache.shape[1] == kt.width(k.shape[1])
        and v_cache.shape[1] == vt.width(v.shape[1])
        and cpu_lib.lib() is not None
    )


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    cs: torch.Tensor | None,
    n_rot: int,
    neox: bool,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    tk: KVType | None = None,
    tv: KVType | None = None,
    rot_k: int = 0,
    rot_v: int = 0,
    lib: ctypes.CDLL | None = None,
    q_scale: float = 1.0,
) -> None:
    """q [n, n_head * head_dim] and k [n, n_head_kv * head_dim] rotated in place by cs ([n,
    n_rot / 2, 2] (cos, sin) per pair, float32, last two dims contiguous; None: not rotated),
    and where rot_k > 0 by the Hadamard rotation of that size; then k_cache[rows[i]] = k[i] and
    v_cache[rows[i]] = v[i] (V turned by the rotation of size rot_v > 0, v itself untouched) in
    the caches' types (tk/tv: a quantized cache's). q is multiplied by q_scale after the RoPE and
    before the Hadamard rotation (Gemma's ggml_scale of Qcur). Needs `applies`; rows int64,
    distinct, within the caches. `lib`: another build of the kernels."""
    lib = lib or cpu_lib.lib()
    kt, vt = cache_type(k_cache, tk), cache_type(v_cache, tv)
    assert lib is not None and kt is not None and vt is not None
    n = q.shape[0]
    laid_out = cs is None or (cs.dtype == torch.float32 and cs.stride(2) == 1 and cs.stride(1) == 2)
    if cs is not None and (not laid_out or cs.shape[0] != n):
        cs = cs.float().contiguous()
    if rows.dtype != torch.int64 or not rows.is_contiguous():
        rows = rows.long().contiguous()
    rc = lib.kvr_rope_store(
        q.data_ptr(), q.stride(0), q.shape[1] // head_dim,
        k.data_ptr(), k.stride(0), k.shape[1] // head_dim, head_dim,
        v.data_ptr(), v.stride(0), v.shape[1], n,
        None if cs is None else cs.data_ptr(), 0 if cs is None else cs.stride(0), n_rot, int(neox), q_scale,
        k_cache.data_ptr(), k_cache.stride(0), v_cache.data_ptr(), v_cache.stride(0),
        C_IDS[kt.name], C_IDS[vt.name], rot_k, rot_v, rows.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"rope_store: bad call (q {tuple(q.shape)}, k {tuple(k.shape)}, n_rot {n_rot})")
