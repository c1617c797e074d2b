"""Decoder layers for a small ubatch in one compiled call (decoder_cpu.c via cpu_lib): the llama
family's and the Gemma family's (the options each member needs: kernels/decoder_cpu.c).

Per layer: RMS norm and the Q/K/V matmul, (Gemma) RMS norm of each Q and K head, RoPE ((Gemma)
then Q scaled) and the K/V store into the cache, attention per stream, output projection plus
residual ((Gemma) normed first), normed gated feed-forward plus residual (SwiGLU; Gemma: GELU,
its output normed). These are the computations the op-by-op forwards (kvtool/models/llama.py,
gemma3.py: the specification) make one kernel call or torch op at a time, chained in C in the
same order with the same roundings, so the bits are the same. At one token the Python calls
between kernels cost milliseconds a token; this is one call for all layers.

`DecoderWeights` describes the layers' weights once (at load); `run` takes the per-layer caches
and the ubatch's views (rows, rotation table and mask; one per kind of cache: Gemma's
sliding-window layers have their own).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtool.kernels import attention_cpu, cpu_lib
from kvtool.kernels.kv_quant import C_IDS, KV_TYPES, KVType
from kvtool.kernels.qmatmul import QWeight

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Layer(ctypes.Structure):  # decoder_cpu.c's kvl_layer
    _fields_ = [
        ("wqkv", _ptr), ("wk", _ptr), ("wv", _ptr), ("wo", _ptr), ("gate_up", _ptr), ("down", _ptr),
        ("attn_norm", _ptr), ("ffn_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
        ("attn_post_norm", _ptr), ("ffn_post_norm", _ptr), ("gelu", _ptr),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("n_head", _i64), ("n_head_kv", _i64), ("hd_k", _i64), ("hd_v", _i64), ("n_rot", _i64),
        ("neox", ctypes.c_int), ("ub", ctypes.c_int),
        ("qkv_bias", _ptr), ("res_scale", ctypes.c_float), ("softcap", ctypes.c_float),
        ("qk_norm_all", ctypes.c_int), ("q_scale", ctypes.c_float),
    ]  # fmt: skip


class _Cache(ctypes.Structure):  # kvl_cache
    _fields_ = [
        ("k", _ptr), ("v", _ptr),
        ("sk_s", _i64), ("sk_c", _i64), ("sk_h", _i64), ("sv_s", _i64), ("sv_c", _i64), ("sv_h", _i64),
        ("n_cells", _i64), ("type_k", ctypes.c_int), ("type_v", ctypes.c_int),
        ("rot_k", _i64), ("rot_v", _i64),
    ]  # fmt: skip


class _UBatch(ctypes.Structure):  # kvl_ubatch
    _fields_ = [
        ("n", _i64), ("n_stream", _i64), ("stream0", _i64), ("n_kv", _i64),
        ("rows", _ptr), ("cs", _ptr), ("ldcs", _i64), ("mask", _ptr), ("sm_s", _i64), ("sm_i", _i64),
    ]  # fmt: skip


@dataclass
class LayerWeights:
    """One layer as the compiled call takes it: quantized weights without biases (wqkv stacks Q,
    K and V, or with wk and wv is Q alone; gate_up the gate then the up weight) and norm weights
    (None: no norm before the block, olmo2); where the layer has them, the Q/K/V bias (qwen2), the
    per-head Q/K norms (or over the whole of Q and K: `qk_norm_all`, olmo2), the post-attention /
    post-FFN norms, a residual scale (granite) and an attention soft-cap (Gemma 2)."""

    wqkv: QWeight
    wo: QWeight
    gate_up: QWeight
    down: QWeight
    attn_norm: torch.Tensor | None
    ffn_norm: torch.Tensor | None
    wk: QWeight | None = None
    wv: QWeight | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_post_norm: torch.Tensor | None = None
    ffn_post_norm: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    qk_norm_all: bool = False
    res_scale: float = 0.0
    softcap: float = 0.0


@dataclass
class UBatchView:
    """What the layers attending with one kind of cache share: rows [n] int64 the cache rows
    (stream * n_cells + cell) of the ubatch's K/V, cs [n, n_rot / 2, 2] the rotation's (cos, sin),
    mask [n_stream, n / n_stream, n_kv] additive float32 over the streams from `stream0`."""

    rows: torch.Tensor
    stream0: int
    cs: torch.Tensor
    mask: torch.Tensor


@dataclass
class LayerCache:
    """One layer's K and V caches [n_stream, n_cells, n_head_kv, head_dim] (a quantized type: a
    head's blocks as bytes), their types, and llama.cpp's Hadamard rotations (0: none)."""

    k: torch.Tensor
    v: torch.Tensor
    type_k: KVType = KV_TYPES["f16"]
    type_v: KVType = KV_TYPES["f16"]
    rot_k: int = 0
    rot_v: int = 0


class DecoderWeights:
    """The layers' descriptions, made once; the tensors they point into are kept alive here."""

    def __init__(
        self,
        layers: Sequence[LayerWeights],
        *,
        n_head: Sequence[int],
        n_head_kv: Sequence[int],
        head_dim_k: int,
        head_dim_v: int,
        n_rot: int,
        neox: bool,
        eps: float,
        scale: float,
        view: Sequence[int] | None = None,
        gelu: torch.Tensor | None = None,
        q_scale: float = 1.0,
    ) -> None:
        """`scale`: the attention's scale of Q.K; `q_scale`: Q is multiplied by it after the RoPE
        (Gemma: llama.cpp scales Qcur and attends with scale 1, an order that changes the bits of
        a Q quantized for a quantized K). `view[il]`: which of `run`'s ubatch views layer il
        attends with (all 0 by default); `gelu`: the feed-forward is GELU-gated with this table
        (qmatmul.ffn_glu), else SwiGLU."""
        self._keep: list[torch.Tensor] = []

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.float().contiguous()
            self._keep.append(t)
            return t.data_ptr()

        def desc(w: QWeight | None) -> int | None:
            return w._desc_ptr if w is not None else None

        arr = (_Layer * len(layers))()
        for il, L in enumerate(layers):
            weights = (desc(w) for w in (L.wqkv, L.wk, L.wv, L.wo, L.gate_up, L.down))
            norms = (L.attn_norm, L.ffn_norm, L.q_norm, L.k_norm, L.attn_post_norm, L.ffn_post_norm, gelu)
            arr[il] = _Layer(
                *weights, *map(ptr, norms), eps, scale,
                n_head[il], n_head_kv[il], head_dim_k, head_dim_v, n_rot, int(neox),
                view[il] if view is not None else 0,
                ptr(L.qkv_bias), L.res_scale, L.softcap, int(L.qk_norm_all), q_scale,
            )  # fmt: skip
        self.view = list(view) if view is not None else [0] * len(layers)
        self.n_view = 1 + max(self.view, default=0)
        self._layers = layers  # the QWeights own the descriptions the structs point to
        self._arr = arr
        self._base = ctypes.addressof(arr)
        self.n_layer = len(layers)
        self._caches: dict[
            tuple[object, ...], tuple[list[weakref.ref[torch.Tensor]], ctypes.Array[_Cache]]
        ] = {}

    def _cache_structs(self, caches: Sequence[LayerCache]) -> ctypes.Array[_Cache] | None:
        """The caches' descriptions, made once per set of cache tensors: an entry is keyed by the
        tensors' identities and holds weak references to them, so a freed cache's address reused
        by another tensor never finds a stale description (and no cache is kept alive here)."""
        tensors = [t for c in caches for t in (c.k, c.v)]
        key = (
            *map(id, tensors),
            *(x for c in caches for x in (c.type_k.name, c.type_v.name, c.rot_k, c.rot_v)),
        )
        hit = self._caches.get(key)
        if hit is not None and all(r() is t for r, t in zip(hit[0], tensors, strict=True)):
            return hit[1]
        arr = (_Cache * len(caches))()
        for i, c in enumerate(caches):
            k, v = c.k, c.v
            ok = (
                k.dim() == 4 and v.dim() == 4 and k.dtype == c.type_k.dtype and v.dtype == c.type_v.dtype
                and k.device.type == "cpu" and v.device.type == "cpu"
                and k.stride(3) == 1 and v.stride(3) == 1
                and k.stride(0) == k.shape[1] * k.stride(1) and v.stride(0) == v.shape[1] * v.stride(1)
                and k.shape[:2] == v.shape[:2]
            )  # fmt: skip
            if not ok:
                return None
            arr[i] = _Cache(
                k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), k.shape[1], C_IDS[c.type_k.name], C_IDS[c.type_v.name],
                c.rot_k, c.rot_v,
            )  # fmt: skip
        if len(self._caches) >= 8:  # contexts come and go: keep the recent ones
            self._caches.clear()
        self._caches[key] = ([weakref.ref(t) for t in tensors], arr)
        return arr

    def run(
        self, x: torch.Tensor, il0: int, caches: Sequence[LayerCache], views: Sequence[UBatchView]
    ) -> bool:
        """x [n, n_embd] float32 through layers il0 .. il0 + len(caches) - 1 in place, each layer
        attending with its view (`UBatchView`; `views` holds all `n_view` of them). False (x
        untouched) where the call does not take these."""
        lib = cpu_lib.lib()
        n = x.shape[0]
        if lib is None or len(views) != self.n_view or not 0 <= il0 <= self.n_layer - len(caches):
            return False
        if x.dtype != torch.float32 or x.stride(1) != 1 or x.device.type != "cpu":
            return False
        structs = self._cache_structs(caches)
        if structs is None:
            return False
        ubs = (_UBatch * len(views))()
        reach = []  # per view: the cells and streams a cache attending with it must have
        for u, v in enumerate(views):
            mask, rows, cs = v.mask, v.rows, v.cs
            S, per, n_kv = mask.shape
            if per > attention_cpu.MAX_ROWS or S * per != n:
                return False
            if mask.dtype != torch.float32 or not mask.is_contiguous() or mask.device.type != "cpu":
                return False
            if rows.dtype != torch.int64 or not rows.is_contiguous() or rows.shape != (n,):
                return False
            if cs.dtype != torch.float32 or cs.shape[0] != n or cs.stride(2) != 1 or cs.stride(1) != 2:
                return False
            reach.append((n_kv, v.stream0 + S))
            ubs[u] = _UBatch(n, S, v.stream0, n_kv, rows.data_ptr(), cs.data_ptr(), cs.stride(0))
            ubs[u].mask, ubs[u].sm_s, ubs[u].sm_i = mask.data_ptr(), per * n_kv, n_kv
        for il, c in enumerate(caches, il0):
            n_kv, streams = reach[self.view[il]]
            if c.k.shape[1] < n_kv or c.k.shape[0] < streams:
                return False
        layers, structs_p = self._base + il0 * ctypes.sizeof(_Layer), ctypes.addressof(structs)
        args = (ctypes.addressof(ubs), len(views), x.data_ptr(), x.stride(0))
        rc = lib.kvl_layers(layers, structs_p, len(caches), *args)
        if rc != 0:
            raise ValueError(f"decoder_cpu: bad call (x {tuple(x.shape)}, {len(views)} views)")
        return True
