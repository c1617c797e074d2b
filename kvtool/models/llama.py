"""The `llama` architecture (Llama, SmolLM2, TinyLlama...): RMSNorm, RoPE (NORM), GQA, SwiGLU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtool.batch import UBatch
from kvtool.gguf_file import GGUFFile
from kvtool.kernels.decoder_cpu import DecoderWeights, LayerWeights
from kvtool.memory.base import MemoryContext
from kvtool.memory.kv_cache import KVLayerSpec
from kvtool.memory.spec import KVSpec
from kvtool.models.compiled import compiled_layers, decoder_weights, gate_up_pair, native, native_group
from kvtool.models.hparams import HParams
from kvtool.models.inputs import ForwardInputs, forward_inputs
from kvtool.models.layers import rms_norm, rope_attend, swiglu_normed
from kvtool.models.linear import Embedding, Linear, LinearGroup, linear_normed, load_linear, output_linear
from kvtool.models.rope import RopeParams, apply_rope


@dataclass
class LlamaLayer:
    attn_norm: torch.Tensor  # [n_embd]
    wqkv: LinearGroup  # q [n_head * hd, n_embd], k [n_head_kv * hd, n_embd], v [n_head_kv * hd_v, n_embd]
    wo: Linear  # [n_embd, n_head * hd_v]
    ffn_norm: torch.Tensor
    ffn_gate_up: LinearGroup  # gate, up [n_ff, n_embd]
    ffn_down: Linear  # [n_embd, n_ff]


def _opt(f: GGUFFile, name: str) -> torch.Tensor | None:
    return f.tensor(name) if f.has_tensor(name) else None


class LlamaModel:
    """Weights and forward pass of the llama architecture."""

    def __init__(self, f: GGUFFile, hp: HParams, weights: str = "auto") -> None:
        self.hp = hp
        self.tok_embd = Embedding(f, "token_embd.weight", weights)  # [n_vocab, n_embd]
        self.output_norm = f.tensor("output_norm.weight")
        self.output = output_linear(f, weights, self.tok_embd)  # tied embeddings if absent

        def group(il: int, names: list[str], bias: bool = False) -> LinearGroup:
            biases = [_opt(f, f"blk.{il}.{n}.bias") if bias else None for n in names]
            return LinearGroup(f, [f"blk.{il}.{n}.weight" for n in names], weights, biases)

        self.layers = [
            LlamaLayer(
                attn_norm=f.tensor(f"blk.{il}.attn_norm.weight"),
                wqkv=group(il, ["attn_q", "attn_k", "attn_v"], bias=True),
                wo=load_linear(f, f"blk.{il}.attn_output.weight", weights),
                ffn_norm=f.tensor(f"blk.{il}.ffn_norm.weight"),
                ffn_gate_up=group(il, ["ffn_gate", "ffn_up"]),
                ffn_down=load_linear(f, f"blk.{il}.ffn_down.weight", weights),
            )
            for il in range(hp.n_layer)
        ]
        self.rope = RopeParams(
            n_rot=hp.n_rot,
            base=hp.rope_base,
            freq_scale=hp.rope_freq_scale,
            neox=False,
            freq_factors=_opt(f, "rope_freqs.weight"),
        )
        self.decoder = _decoder_weights(self.layers, hp, self.rope)

    def memory_spec(self) -> KVSpec:
        hp = self.hp
        layers = {il: KVLayerSpec(hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v) for il in range(hp.n_layer)}
        return KVSpec(layers, shift=self.rope_shift)

    def rope_shift(self, il: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Re-rotate cached K rows [n, n_head_kv, hd] by position deltas [n]."""
        return apply_rope(k, self.rope.rotation(delta), self.rope)

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """Logits [n_outputs, n_vocab] for the ubatch rows flagged as outputs, in row order."""
        return self.compute(self.inputs(ub), ub, mctx)

    def inputs(self, ub: UBatch) -> ForwardInputs:
        """The ubatch's inputs on the model's device (kvtool/models/inputs.py)."""
        return forward_inputs(ub, self.output_norm.device, [self.rope])

    def compute(self, inp: ForwardInputs, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """`forward` from inputs on the device: no host data is read but the ubatch's shape."""
        hp = self.hp
        x = self.tok_embd(inp.token)  # [n, n_embd]
        rot = self.rope.rotation(inp.pos, inp.bounds)
        scale = 1.0 / math.sqrt(hp.head_dim_k)
        for il in range(compiled_layers(self.decoder, ub, mctx, x, [rot.cs]), hp.n_layer):
            L = self.layers[il]
            q, k, v = L.wqkv.normed(x, L.attn_norm, hp.eps, rms_norm)  # rows [n, heads * head_dim]
            a = rope_attend(mctx.layer_view(il), q, k, v, hp.head_dim_k, rot, self.rope, scale)
            x += L.wo(a)  # x is this forward's own tensor
            if il == hp.n_layer - 1 and not ub.output.all():
                x = x[torch.from_numpy(ub.output).to(x.device)]  # only output rows need the rest
            x += swiglu_normed(x, L.ffn_norm, hp.eps, L.ffn_gate_up, L.ffn_down)
        return linear_normed(self.output, x, self.output_norm, hp.eps, rms_norm)


def _decoder_weights(layers: list[LlamaLayer], hp: HParams, rope: RopeParams) -> DecoderWeights | None:
    """The layers' description for the compiled decoder call, or None where a layer's weights
    are not all in the compiled quantized kernel without biases."""
    parts = []
    for L in layers:
        qkv, wo, down = native_group(L.wqkv), native(L.wo), native(L.ffn_down)
        gu = gate_up_pair(L.ffn_gate_up)
        if qkv is None or len(qkv) != 1 or wo is None or gu is None or down is None:
            return None
        parts.append(LayerWeights(qkv[0], wo, gu, down, L.attn_norm, L.ffn_norm))
    return decoder_weights(parts, hp, n_rot=rope.n_rot, neox=rope.neox, scale=1.0 / math.sqrt(hp.head_dim_k))
