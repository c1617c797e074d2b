"""Building blocks shared by the architectures: norms, feed-forward, attention over the KV cache
(RoPE is kvtool/models/rope.py)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvtool.kernels import rms_norm_cpu, rope_store_cpu
from kvtool.kernels.attention import attention, attention_cells
from kvtool.kernels.attention_softcap import attention_softcap
from kvtool.kernels.hadamard import fwht
from kvtool.kernels.store_kv import store_kv
from kvtool.memory.kv_cache_context import KVView
from kvtool.models.linear import Linear, LinearGroup, glu_native
from kvtool.models.rope import RopeParams, Rotation, apply_rope


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * w / sqrt(mean(x^2) + eps) over the last dim (ggml_rms_norm then a multiply).

    One torch op, bit-identical in float32 to the spelled-out formula; a weight that is not
    one value per element of the last dim (Mamba-2's per-group norm) is broadcast after."""
    if w is None or w.shape == x.shape[-1:]:
        return torch.rms_norm(x, x.shape[-1:], w, eps)
    return torch.rms_norm(x, x.shape[-1:], None, eps) * w


def rms_norm_ggml(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` with ggml's arithmetic (the sum of squares in double) on the CPU, where the
    compiled kernels run: the bits of the compiled decoder call's norms (kernels/rms_norm_cpu.py),
    so that a forward that norms op by op and the call agree. torch's elsewhere."""
    if rms_norm_cpu.applies(x, w):
        return rms_norm_cpu.rms_norm_cpu(x, w, eps)
    return rms_norm(x, w, eps)


def swiglu(x: torch.Tensor, gate_up: LinearGroup, down: Linear) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); one call of the compiled kernel where it applies."""
    y = glu_native(x, gate_up, down)
    if y is not None:
        return y
    gate, up = gate_up(x)
    return down(F.silu(gate) * up)


def swiglu_normed(
    x: torch.Tensor, w: torch.Tensor, eps: float, gate_up: LinearGroup, down: Linear
) -> torch.Tensor:
    """swiglu(rms_norm(x, w, eps)), the norm inside the compiled call where that applies."""
    y = glu_native(x, gate_up, down, norm=(w, eps))
    return y if y is not None else swiglu(rms_norm(x, w, eps), gate_up, down)


_SQRT_2_OVER_PI = 0.79788456080286535587989211986876
_GELU_COEF_A = 0.044715


def _gelu_half(xh: torch.Tensor) -> torch.Tensor:
    """tanh-GELU of half values (as float32), evaluated in float32 and rounded to a half."""
    g = 0.5 * xh * (1.0 + torch.tanh(_SQRT_2_OVER_PI * xh * (1.0 + _GELU_COEF_A * xh * xh)))
    return g.to(torch.float16).float()


def gelu_ggml(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU as ggml computes it on CPU (GGML_GELU_FP16): x is rounded to fp16 and the result
    looked up in an fp16 table of tanh-GELU, except x <= -10 -> 0 and x >= 10 -> x. Rounding in and
    out of fp16 around an f32 evaluation reproduces the table. On the tiny gemma3 oracle model this
    brings kvtool 2-5x closer to llama.cpp than exact tanh-GELU (max rel 1.3e-4 instead of 3.9e-4)."""
    g = _gelu_half(x.to(torch.float16).float())
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, g))


@functools.cache
def gelu_table() -> torch.Tensor:
    """`gelu_ggml`'s value for every half, by its bits ([65536] float32; ±10 and beyond are the
    caller's): the compiled feed-forward rounds the gate to a half and looks it up, as ggml does."""
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return _gelu_half(halves.float()).contiguous()


def geglu(x: torch.Tensor, gate_up: LinearGroup, down: Linear) -> torch.Tensor:
    """down(gelu(gate(x)) * up(x)) with ggml's CPU GELU (llama.cpp's LLM_FFN_GELU + LLM_FFN_PAR):
    one call of the compiled kernel with `gelu_table` where it applies."""
    y = glu_native(x, gate_up, down, gelu=gelu_table())
    if y is not None:
        return y
    gate, up = gate_up(x)
    return down(gelu_ggml(gate) * up)


def attend(
    view: KVView, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0
) -> torch.Tensor:
    """Stores the ubatch's K/V rows in the layer's cache, then attends per stream.

    q [n, n_head, d_k], k [n, n_head_kv, d_k], v [n, n_head_kv, d_v] -> [n, n_head * d_v]; k and v
    may also come as rows [n, n_head_kv * d] (what the cache stores: no reshape back and forth).
    The cache is read in its own type (f16/bf16/f32, or a quantized type's blocks): the kernel
    converts inside. Where the view asks for llama.cpp's Hadamard rotation, Q and K are rotated
    before K is stored, V before it is stored and the output back. `softcap`: the scores are
    soft-capped (kernels/attention_softcap.py)."""
    n = q.shape[0]
    if view.rot_k:
        q, k = fwht(q, view.rot_k), fwht(k, view.rot_k)
    if view.rot_v:
        v = fwht(v, view.rot_v)
    store_kv(view.k_rows, k if k.dim() == 2 else k.reshape(n, -1), view.rows, view.type_k)
    store_kv(view.v_rows, v if v.dim() == 2 else v.reshape(n, -1), view.rows, view.type_v)
    return _attend_stored(view, q, scale, softcap)


def rope_attend(
    view: KVView,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    head_dim: int,
    rot: Rotation,
    rope: RopeParams,
    scale: float,
) -> torch.Tensor:
    """attend(view, rope(q), rope(k), v, scale) for q, k, v as rows [n, heads * head_dim]: on
    the CPU the rotation and the K/V store are one compiled call (kernels/rope_store_cpu.c,
    which rotates q and k in place), else op by op."""
    n = q.shape[0]
    if rot.cs is not None and rope_store_cpu.applies(
        q, k, v, view.k_rows, view.v_rows, view.type_k, view.type_v
    ):
        cs, k_rows, v_rows = rot.cs, view.k_rows, view.v_rows
        rope_store_cpu.rope_store(
            q, k, v, head_dim, cs, rope.n_rot, rope.neox, k_rows, v_rows, view.rows,
            view.type_k, view.type_v, view.rot_k, view.rot_v,
        )  # fmt: skip
        return _attend_stored(view, q.view(n, -1, head_dim), scale)
    q = apply_rope(q.reshape(n, -1, head_dim), rot, rope)
    k = apply_rope(k.reshape(n, -1, head_dim), rot, rope)
    return attend(view, q, k, v, scale)


def _attend_stored(view: KVView, q: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    # the ubatch's K/V rows are in the cache (q rotated where the view asks): attend per stream
    n = q.shape[0]
    n_s = view.streams.stop - view.streams.start
    qs = q.reshape(n_s, n // n_s, q.shape[1], q.shape[2])  # [n_stream_ub, n / n_stream_ub, n_head, d_k]
    ks, vs = view.attended()  # [n_stream_ub, n_kv, n_head_kv, d (a quantized type: its blocks' bytes)]
    tk, tv = view.type_k, view.type_v
    if softcap:
        seen = view.cells if view.cells is not None else view.mask
        assert seen is not None
        out = attention_softcap(qs, ks, vs, seen, scale, softcap, tk, tv)
    elif view.cells is not None:  # on CUDA: the kernel decides visibility from the cells
        out = attention_cells(qs, ks, vs, view.cells, scale, tk, tv)
    else:
        assert view.mask is not None
        out = attention(qs, ks, vs, view.mask, scale, tk, tv)
    out = out.reshape(n, -1)
    return fwht(out, view.rot_v) if view.rot_v else out
