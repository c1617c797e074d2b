"""The backend's bridge to the compiled decoder call (kernels/decoder_cpu.py): a model describes
its layers in its own objects (kvtool/models/layers.py's `DecoderLayer`); this finds the weights
the compiled kernel holds, builds the call's description once at load, and runs a small
ubatch's first layers through it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtool.backend.linear import QUANT_MAX_ROWS, Linear, LinearGroup, QuantLinear
from kvtool.batch import UBatch
from kvtool.kernels.decoder_cpu import DecoderWeights, LayerCache, LayerWeights, UBatchView
from kvtool.kernels.qmatmul import QWeight
from kvtool.memory.base import MemoryContext
from kvtool.memory.kv_cache_context import KVView
from kvtool.models.hparams import HParams
from kvtool.models.layers import DecoderLayer, DecoderOptions


def native(lin: Linear | None) -> QWeight | None:
    """The weight of a layer the compiled kernel computes (quantized, no bias), else None."""
    return lin.native if isinstance(lin, QuantLinear) and lin.bias is None else None


def native_group(group: LinearGroup) -> list[QWeight] | None:
    """A group's weights for the compiled call: [stacked] when fused, else one per part; None
    where one is not in the kernel."""
    if group.fused is not None:
        w = native(group.fused)
        return [w] if w is not None else None
    parts = [w for p in group.parts if (w := native(p)) is not None]
    return parts if len(parts) == len(group.parts) else None


def native_group_bias(group: LinearGroup) -> tuple[list[QWeight], torch.Tensor | None] | None:
    """`native_group` for a group whose weights may carry biases (qwen2's Q/K/V): the weights
    and their biases stacked as the call's rows are (None: no bias at all)."""
    lins = [group.fused] if group.fused is not None else group.parts
    if not all(isinstance(p, QuantLinear) and p.native is not None for p in lins):
        return None
    quant = [p for p in lins if isinstance(p, QuantLinear)]
    weights = [p.native for p in quant if p.native is not None]
    if all(p.bias is None for p in quant):
        return weights, None
    rows = [w.n_out for w in weights]
    biases = [p.bias if p.bias is not None else torch.zeros(n) for p, n in zip(quant, rows, strict=True)]
    return weights, torch.cat(biases)


def gate_up_pair(group: LinearGroup) -> QWeight | None:
    """A feed-forward's gate and up weights stacked in one compiled weight of equal halves."""
    if len(group.sizes) != 2 or group.sizes[0] != group.sizes[1]:
        return None
    return native(group.fused)


def _layer_weights(layer: DecoderLayer) -> LayerWeights | None:
    """The layer's weights for the compiled call, or None where one is not in the compiled
    quantized kernel, or carries a bias the call does not take."""
    L = layer.block
    if layer.qkv_bias:
        qkv_b = native_group_bias(L.wqkv)
    else:
        group = native_group(L.wqkv)
        qkv_b = (group, None) if group is not None else None
    wo, down, gu = native(L.wo), native(L.ffn_down), gate_up_pair(L.ffn_gate_up)
    if qkv_b is None or len(qkv_b[0]) not in (1, 3) or wo is None or gu is None or down is None:
        return None
    qkv_w, bias = qkv_b
    wk, wv = (qkv_w[1], qkv_w[2]) if len(qkv_w) == 3 else (None, None)
    out = LayerWeights(qkv_w[0], wo, gu, down, L.attn_norm, L.ffn_norm, wk, wv, L.q_norm, L.k_norm)
    out.attn_post_norm, out.ffn_post_norm = L.attn_post_norm, L.ffn_post_norm
    out.qkv_bias, out.qk_norm_all, out.res_scale = bias, layer.qk_norm_all, layer.res_scale
    out.softcap = layer.softcap
    return out


def decoder_weights(
    layers: Sequence[DecoderLayer], hp: HParams, opts: DecoderOptions
) -> DecoderWeights | None:
    """The compiled call's description of a model's layers, with the shapes `hp` gives; None
    where a layer is not all in the compiled kernel."""
    parts = [_layer_weights(L) for L in layers]
    if any(p is None for p in parts):
        return None
    return DecoderWeights(
        [p for p in parts if p is not None],
        n_head=[hp.n_head] * hp.n_layer,
        n_head_kv=hp.n_head_kv,
        head_dim_k=hp.head_dim_k,
        head_dim_v=hp.head_dim_v,
        n_rot=opts.n_rot,
        neox=opts.neox,
        eps=hp.eps,
        scale=opts.scale,
        view=opts.view,
        gelu=opts.gelu,
        q_scale=opts.q_scale,
    )


def compiled_layers(
    decoder: DecoderWeights | None,
    ub: UBatch,
    mctx: MemoryContext,
    x: torch.Tensor,
    cs: Sequence[torch.Tensor | None],
) -> int:
    """Runs the first layers of a small ubatch in one compiled call where it applies (every
    layer, or all but the last when only some rows are outputs: that one computes fewer rows);
    returns how many it ran, 0 where it does not apply. cs[u]: the rotation table of the layers
    attending with view u (`DecoderWeights.view`)."""
    if decoder is None or ub.n_tokens > QUANT_MAX_ROWS or any(c is None for c in cs):
        return 0
    n = decoder.n_layer if ub.output.all() else decoder.n_layer - 1
    views = [mctx.layer_view(il) for il in range(n)]
    first: dict[int, KVView] = {}
    kvs: list[KVView] = []
    for il, v in enumerate(views):
        if not isinstance(v, KVView) or v.mask is None:
            return 0
        kvs.append(v)
        f = first.setdefault(decoder.view[il], v)
        if v.rows is not f.rows or v.mask is not f.mask or v.streams != f.streams:
            return 0
    if sorted(first) != list(range(decoder.n_view)) or len(cs) != decoder.n_view:
        return 0
    shared = []
    for u in range(decoder.n_view):
        v, c = first[u], cs[u]
        assert v.mask is not None and c is not None
        shared.append(UBatchView(v.rows, v.streams.start, c, v.mask.mask))
    caches = [LayerCache(v.k, v.v, v.type_k, v.type_v, v.rot_k, v.rot_v) for v in kvs]
    return n if decoder.run(x, 0, caches, shared) else 0
