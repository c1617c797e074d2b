"""The llama family of decoders: `llama` (Llama, SmolLM2, TinyLlama...) and the architectures that
llama.cpp builds the same way but for a few switches (`Variant`: qwen2, qwen3, phi3, granite,
olmo2, each declared in its own module). Per layer: RMS norm, Q/K/V projection (three weights or
one fused `attn_qkv`, optional biases), RoPE, attention over the KV cache, output projection,
residual; RMS norm, SwiGLU feed-forward, residual.

Every tensor is named and shaped once, below, where it is loaded (kvtool/models/tensors.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtool.backend.linear import Linear, LinearGroup, linear_normed
from kvtool.batch import UBatch
from kvtool.errors import KvtoolError, ModelLoadError
from kvtool.memory.base import MemoryContext
from kvtool.memory.kv_cache_context import KVView
from kvtool.memory.spec import KVSpec
from kvtool.memory.views import kv_view
from kvtool.models.hparams import GraniteScales, SWAHParams, read_int
from kvtool.models.inputs import ForwardInputs, forward_inputs
from kvtool.models.kv_layers import KVLayers
from kvtool.models.layers import DecoderLayer, DecoderOptions, rms_norm, swiglu, swiglu_normed
from kvtool.models.rope import RopeParams, Rotation
from kvtool.models.tensors import AttnDims, Dim, ModelTensors

if TYPE_CHECKING:  # the backend imports the models' building blocks
    from kvtool.backend.ops import Decoder


@dataclass(frozen=True)
class Variant:
    """What an architecture of the family changes (llama.cpp's graph builder for it)."""

    neox: bool = False  # NEOX RoPE (pairs i, i + n_rot/2) instead of NORM (adjacent pairs)
    qk_norm: str = ""  # "head": Q and K RMS-normed per head (qwen3); "all": over the whole projection (olmo2)
    pre_norm: bool = True  # attn_norm / ffn_norm before each block
    post_norm: bool = False  # post_attention_norm / post_ffw_norm on each block's output (olmo2)
    fused_up: bool = False  # one ffn_up [2 * n_ff, n_embd] holding the gate, then up (phi3)
    scales: bool = False  # granite's embedding, residual, attention and logit scales
    output_required: bool = False  # no tied output (olmo2)
    swa_pattern: int = 0  # where the GGUF sets a window, layers slide by this pattern (olmo2: 4)
    rope_factors: str = "rope_freqs"  # the frequency factors' tensor, or "short": phi3's rope_factors_short


LLAMA = Variant()


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor | None  # [n_embd]
    wqkv: LinearGroup  # q [n_head * hd, n_embd], k [n_head_kv * hd, n_embd], v [n_head_kv * hd_v, n_embd]
    q_norm: torch.Tensor | None  # [hd] per head, or [n_head * hd] over the projection
    k_norm: torch.Tensor | None
    wo: Linear  # [n_embd, n_head * hd_v]
    attn_post_norm: torch.Tensor | None  # [n_embd]
    ffn_norm: torch.Tensor | None  # [n_embd]
    ffn_gate_up: LinearGroup  # gate, up [n_ff, n_embd]
    ffn_down: Linear  # [n_embd, n_ff]
    ffn_post_norm: torch.Tensor | None  # [n_embd]


def qkv(t: ModelTensors, il: int, d: AttnDims) -> LinearGroup:
    """Q, K and V of layer il: one `attn_qkv` weight where the file has it, else three, with
    optional biases (llama.cpp's create_tensor_qkv)."""
    p = f"blk.{il}."
    if t.has(p + "attn_qkv.weight"):
        return t.group(
            [(p + "attn_qkv.weight", (d.q + d.k + d.v, d.embd))], [p + "attn_qkv.bias"], (d.q, d.k, d.v)
        )
    names = [p + "attn_q", p + "attn_k", p + "attn_v"]
    parts = [(n + ".weight", (size, d.embd)) for n, size in zip(names, (d.q, d.k, d.v), strict=True)]
    return t.group(parts, [n + ".bias" for n in names])


def load_layer(t: ModelTensors, il: int, v: Variant) -> LlamaLayer:
    p, E, F = f"blk.{il}.", t.n_embd, t.n_ff(il)
    d = t.attention(il)

    def norm(name: str, on: bool, size: Dim = E) -> torch.Tensor | None:
        return t.tensor(p + name + ".weight", (size,)) if on else None

    q_size, k_size = (d.head_k, d.head_k) if v.qk_norm == "head" else (d.q, d.k)
    if v.fused_up:
        gate_up = t.group([(p + "ffn_up.weight", (2 * F, E))], split=(F, F))
    else:
        parts = [(p + "ffn_gate.weight", (F, E)), (p + "ffn_up.weight", (F, E))]
        gate_up = t.group(parts, [p + "ffn_gate.bias", p + "ffn_up.bias"])
    return LlamaLayer(
        attn_norm=norm("attn_norm", v.pre_norm),
        wqkv=qkv(t, il, d),
        q_norm=norm("attn_q_norm", bool(v.qk_norm), q_size),
        k_norm=norm("attn_k_norm", bool(v.qk_norm), k_size),
        wo=t.linear(p + "attn_output.weight", (E, d.out), p + "attn_output.bias"),
        attn_post_norm=norm("post_attention_norm", v.post_norm),
        ffn_norm=norm("ffn_norm", v.pre_norm),
        ffn_gate_up=gate_up,
        ffn_down=t.linear(p + "ffn_down.weight", (E, F), p + "ffn_down.bias"),
        ffn_post_norm=norm("post_ffw_norm", v.post_norm),
    )


class LlamaModel:
    """Weights and forward pass of an architecture of the llama family."""

    def __init__(self, t: ModelTensors, variant: Variant = LLAMA) -> None:
        f, hp, v = t.f, t.hp, variant
        self.hp, self.v, self.ops = hp, v, t.backend
        if read_int(f, f"{f.arch}.expert_count", 0, lo=0):
            raise ModelLoadError(f"{f.path.name}: {f.arch} mixture-of-experts layers are not supported")
        self.scales = GraniteScales.from_gguf(f) if v.scales else GraniteScales(0.0, 0.0, 0.0, 0.0)
        self.swa = SWAHParams.from_gguf(f, hp.n_layer, v.swa_pattern, hp.rope_base) if v.swa_pattern else None
        self.tok_embd = t.embedding()  # [n_vocab, n_embd]
        self.output_norm = t.tensor("output_norm.weight", (t.n_embd,))
        self.output = t.output(self.tok_embd, v.output_required)  # tied embeddings if absent
        self.layers = [load_layer(t, il, v) for il in range(hp.n_layer)]
        half_rot = t.dim("rope.dimension_count", hp.n_rot) // 2
        factors = "rope_factors_short.weight" if v.rope_factors == "short" else "rope_freqs.weight"
        # LongRoPE's long factors are for contexts past the original length, which kvtool refuses
        self.long_rope_ctx = 0
        if v.rope_factors == "short" and t.optional("rope_factors_long.weight", numel=half_rot) is not None:
            self.long_rope_ctx = read_int(
                f, f"{f.arch}.rope.scaling.original_context_length", hp.n_ctx_train, lo=1
            )
        rope_global = RopeParams(
            n_rot=hp.n_rot, base=hp.rope_base, freq_scale=hp.rope_freq_scale, neox=v.neox,
            freq_factors=t.optional(factors, numel=half_rot), attn_factor=hp.rope_attn_factor,
        )  # fmt: skip
        # sliding layers rotate with their own base and no frequency scaling (llama.cpp's olmo2)
        rope_swa = RopeParams(n_rot=hp.n_rot, base=self.swa.rope_base, neox=v.neox) if self.swa else None
        self.kv = KVLayers(hp, self.swa, rope_global, rope_swa or rope_global)
        self.kq_scale = self.scales.attention or 1.0 / math.sqrt(hp.head_dim_k)
        self.decoder = self._decoder()

    def is_swa(self, il: int) -> bool:
        return self.kv.is_swa(il)

    def rope(self, il: int) -> RopeParams:
        return self.kv.rope(il)

    def memory_spec(self) -> KVSpec:
        return self.kv.memory_spec()

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """Logits [n_outputs, n_vocab] for the ubatch rows flagged as outputs, in row order."""
        return self.compute(self.inputs(ub), ub, mctx)

    def inputs(self, ub: UBatch) -> ForwardInputs:
        """The ubatch's inputs on the model's device (kvtool/models/inputs.py)."""
        return forward_inputs(ub, self.output_norm.device, self.kv.ropes())

    def compute(self, inp: ForwardInputs, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """`forward` from inputs on the device: no host data is read but the ubatch's shape."""
        hp, sc = self.hp, self.scales
        if self.long_rope_ctx:
            self._check_long_rope(mctx)
        x = self.tok_embd(inp.token)  # [n, n_embd]
        if sc.embedding:
            x = x * sc.embedding
        rot = self.kv.rotations(inp)
        cs = [rot[swa].cs for swa in self.kv.kinds]
        for il in range(self.ops.decoder_layers(self.decoder, ub, mctx, x, cs), hp.n_layer):
            x = self._layer(il, x, rot[self.is_swa(il)], ub, mctx)
        logits = linear_normed(self.output, x, self.output_norm, hp.eps, rms_norm)
        return logits / sc.logit if sc.logit else logits

    def _check_long_rope(self, mctx: MemoryContext) -> None:
        """llama.cpp rotates with LongRoPE's long factors when a sequence's context (cells per
        stream) exceeds rope.scaling.original_context_length; kvtool has the short ones only."""
        view = mctx.layer_view(0)
        n_cells = view.k.shape[1] if isinstance(view, KVView) else 0
        if n_cells > self.long_rope_ctx:
            raise KvtoolError(
                f"a context of {n_cells} tokens per sequence needs LongRoPE's long factors "
                f"(beyond rope.scaling.original_context_length {self.long_rope_ctx}), which kvtool does "
                f"not apply: use a context of at most {self.long_rope_ctx} tokens per sequence"
            )

    def _layer(
        self, il: int, x: torch.Tensor, rot: Rotation, ub: UBatch, mctx: MemoryContext
    ) -> torch.Tensor:
        """Layer il on the residual rows x (this forward's own tensor, updated in place where it
        keeps its rows); returns the rows the next layer takes."""
        hp, L, v, rs = self.hp, self.layers[il], self.v, self.scales.residual
        n = x.shape[0]
        if L.attn_norm is not None:
            q, k, val = L.wqkv.normed(x, L.attn_norm, hp.eps, rms_norm)  # rows [n, heads * head_dim]
        else:
            q, k, val = L.wqkv(x)
        if L.q_norm is not None and L.k_norm is not None:  # with the compiled call's bits
            heads = (hp.n_head, hp.n_head_kv[il]) if v.qk_norm == "head" else (1, 1)
            q = self.ops.rms_norm_ggml(q.reshape(n, heads[0], -1), L.q_norm, hp.eps).view(n, -1)
            k = self.ops.rms_norm_ggml(k.reshape(n, heads[1], -1), L.k_norm, hp.eps).view(n, -1)
        view = kv_view(mctx, il)
        a = L.wo(self.ops.rope_attend(view, q, k, val, hp.head_dim_k, rot, self.rope(il), self.kq_scale))
        if il == hp.n_layer - 1 and not ub.output.all():
            out = torch.from_numpy(ub.output).to(x.device)  # only output rows need the rest
            a, x = a[out], x[out]
        x += self._post(a, L.attn_post_norm, rs)
        if L.ffn_norm is not None:
            f = swiglu_normed(x, L.ffn_norm, hp.eps, L.ffn_gate_up, L.ffn_down)
        else:
            f = swiglu(x, L.ffn_gate_up, L.ffn_down)
        x += self._post(f, L.ffn_post_norm, rs)
        return x

    def _decoder(self) -> Decoder | None:
        """The layers' description for the compiled decoder call (None: op by op)."""
        hp, v, res = self.hp, self.v, self.scales.residual
        layers = [DecoderLayer(L, True, v.qk_norm == "all", res) for L in self.layers]
        opts = DecoderOptions(hp.n_rot, v.neox, self.kq_scale, self.kv.views())
        return self.ops.decoder(layers, hp, opts)

    def _post(self, y: torch.Tensor, norm: torch.Tensor | None, scale: float) -> torch.Tensor:
        """A block's output as the residual adds it: normed (post norms, with the compiled call's
        bits), scaled (granite)."""
        if norm is not None:
            y = self.ops.rms_norm_ggml(y, norm, self.hp.eps)
        return y * scale if scale else y


def family(variant: Variant) -> Callable[[ModelTensors], LlamaModel]:
    """The constructor of an architecture of the family."""
    return lambda t: LlamaModel(t, variant)


ARCHITECTURES = {"llama": family(LLAMA)}
