"""The `granitehybrid` architecture (IBM Granite 4.0-H): Mamba-2 layers and attention layers
(a layer with `head_count_kv` 0 is Mamba-2), each followed by a SwiGLU feed-forward, with
Granite's scalars: embeddings times embedding_scale, each block output times residual_scale
before its residual add, attention scaled by attention.scale, logits divided by logit_scale
(llama.cpp's llm_build_granite_hybrid). RoPE (NORM) only when `rope.scaling.finetuned` is not
false: Granite uses that key as the switch for rope."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtool.backend.linear import Linear, LinearGroup, linear_normed
from kvtool.batch import UBatch
from kvtool.errors import ModelLoadError
from kvtool.memory.base import MemoryContext
from kvtool.memory.hybrid import HybridSpec
from kvtool.memory.kv_cache import KVLayerSpec
from kvtool.memory.recurrent import RecurrentSpec
from kvtool.memory.spec import KVSpec
from kvtool.memory.views import kv_view, rs_view
from kvtool.models.hparams import GraniteScales, SSMHParams, read_int
from kvtool.models.layers import rms_norm, swiglu
from kvtool.models.llama import qkv
from kvtool.models.mamba2 import Mamba2Layer, Mamba2Mixer
from kvtool.models.rope import RopeParams, Rotation, apply_rope
from kvtool.models.tensors import ModelTensors


@dataclass
class GraniteAttention:
    wqkv: LinearGroup  # q [n_head * hd, n_embd], k and v [n_head_kv * hd, n_embd] (+ biases)
    wo: Linear  # [n_embd, n_head * hd] (+ bias)

    @classmethod
    def load(cls, t: ModelTensors, il: int, rope: bool) -> GraniteAttention:
        p, d = f"blk.{il}.", t.attention(il, rope)
        return cls(qkv(t, il, d), t.linear(p + "attn_output.weight", (d.embd, d.out), p + "attn_output.bias"))


@dataclass
class GraniteHybridLayer:
    attn_norm: torch.Tensor  # [n_embd]
    mixer: Mamba2Layer | GraniteAttention
    ffn_norm: torch.Tensor  # [n_embd]
    ffn_gate_up: LinearGroup  # gate, up [n_ff, n_embd]
    ffn_down: Linear  # [n_embd, n_ff]


class GraniteHybridModel:
    """Weights and forward pass of granitehybrid (dense feed-forward layers)."""

    def __init__(self, t: ModelTensors) -> None:
        f, hp = t.f, t.hp
        self.hp, self.ops = hp, t.backend
        self.scales = GraniteScales.from_gguf(f)
        self.ssm = s = SSMHParams.from_gguf(f)
        s.check_mamba2(f)
        if read_int(f, f"{f.arch}.expert_count", 0, lo=0) or any(
            t.has(f"blk.{il}.ffn_gate_inp.weight") for il in range(hp.n_layer)
        ):
            raise ModelLoadError(f"{f.path.name}: granitehybrid mixture-of-experts layers are not supported")
        self.mamba = Mamba2Mixer(s, hp.eps, t.backend)
        E = t.n_embd
        self.tok_embd = t.embedding()  # [n_vocab, n_embd]
        self.output_norm = t.tensor("output_norm.weight", (E,))
        self.output = t.output(self.tok_embd)  # tied embeddings if absent
        use_rope = bool(read_int(f, f"{f.arch}.rope.scaling.finetuned", True))

        def layer(il: int) -> GraniteHybridLayer:
            p, F = f"blk.{il}.", t.n_ff(il)
            mixer = (
                Mamba2Layer.load(t, il, s)
                if self.is_recurrent(il)
                else GraniteAttention.load(t, il, use_rope)
            )
            return GraniteHybridLayer(
                attn_norm=t.tensor(p + "attn_norm.weight", (E,)),
                mixer=mixer,
                ffn_norm=t.tensor(p + "ffn_norm.weight", (E,)),
                ffn_gate_up=t.group([(p + "ffn_gate.weight", (F, E)), (p + "ffn_up.weight", (F, E))]),
                ffn_down=t.linear(p + "ffn_down.weight", (E, F)),
            )

        self.layers = [layer(il) for il in range(hp.n_layer)]
        self.rope = (
            RopeParams(n_rot=hp.n_rot, base=hp.rope_base, freq_scale=hp.rope_freq_scale, neox=False)
            if use_rope
            else None
        )
        self.kq_scale = self.scales.attention or 1.0 / math.sqrt(hp.head_dim_k)

    def is_recurrent(self, il: int) -> bool:
        return self.hp.n_head_kv[il] == 0

    def memory_spec(self) -> HybridSpec:
        hp = self.hp
        attn = {
            il: KVLayerSpec(hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v)
            for il in range(hp.n_layer)
            if not self.is_recurrent(il)
        }
        recr = {il: self.mamba.layer_spec() for il in range(hp.n_layer) if self.is_recurrent(il)}
        return HybridSpec(KVSpec(attn, shift=self.rope_shift), RecurrentSpec(recr))

    def rope_shift(self, il: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Re-rotate cached K rows [n, n_head_kv, hd] by position deltas [n] (nothing without rope)."""
        if self.rope is None:
            return k
        return apply_rope(k, self.rope.rotation(delta), self.rope)

    def _attention(
        self,
        il: int,
        A: GraniteAttention,
        h: torch.Tensor,
        rot: Rotation | None,
        mctx: MemoryContext,
    ) -> torch.Tensor:
        hp, n = self.hp, h.shape[0]
        q, k, v = A.wqkv(h)
        q = q.view(n, hp.n_head, hp.head_dim_k)
        k = k.view(n, hp.n_head_kv[il], hp.head_dim_k)
        v = v.view(n, hp.n_head_kv[il], hp.head_dim_v)
        if self.rope is not None and rot is not None:
            q = apply_rope(q, rot, self.rope)
            k = apply_rope(k, rot, self.rope)
        return A.wo(self.ops.attend(kv_view(mctx, il), q, k, v, self.kq_scale))

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """Logits [n_outputs, n_vocab] for the ubatch rows flagged as outputs, in row order."""
        hp, sc = self.hp, self.scales
        x = self.tok_embd(torch.from_numpy(ub.token))  # [n_tokens, n_embd]
        if sc.embedding:
            x = x * sc.embedding
        rot = self.rope.rotation(torch.from_numpy(ub.pos).to(x.device)) if self.rope is not None else None
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, hp.eps)
            if isinstance(L.mixer, Mamba2Layer):
                cur = self.mamba(L.mixer, h, ub, rs_view(mctx, il))
            else:
                cur = self._attention(il, L.mixer, h, rot, mctx)
            if il == hp.n_layer - 1:  # only output rows need the rest
                out = torch.from_numpy(ub.output).to(x.device)
                cur, x = cur[out], x[out]
            x = x + (cur * sc.residual if sc.residual else cur)
            f = swiglu(rms_norm(x, L.ffn_norm, hp.eps), L.ffn_gate_up, L.ffn_down)
            x = x + (f * sc.residual if sc.residual else f)
        logits = linear_normed(self.output, x, self.output_norm, hp.eps, rms_norm)
        return logits / sc.logit if sc.logit else logits


ARCHITECTURES = {"granitehybrid": GraniteHybridModel}
