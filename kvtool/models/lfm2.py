"""The `lfm2` architecture (Liquid LFM2): short-convolution layers and attention layers (a layer
with `head_count_kv` 0 is a convolution), each followed by a SwiGLU feed-forward
(llama.cpp's llm_build_lfm2).

A short-convolution layer projects the normed input to B, C and x, convolves B*x over time with
a depthwise kernel of `shortconv.l_cache` taps (its state: the last l_cache - 1 inputs), gates
the result with C and projects it out. Attention layers norm q and k per head and rotate them
with NEOX RoPE. The final norm's tensor is named `token_embd_norm.weight`; the output head is
tied to the embeddings unless `output.weight` exists.
"""

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
from kvtool.memory.recurrent import RecurrentSpec, RSLayerSpec, RSView
from kvtool.memory.spec import KVSpec
from kvtool.memory.views import kv_view, rs_view
from kvtool.models.hparams import read_int
from kvtool.models.layers import rms_norm, swiglu
from kvtool.models.llama import qkv
from kvtool.models.mamba_layers import seq_blocks, store
from kvtool.models.rope import RopeParams, Rotation, apply_rope
from kvtool.models.tensors import Dim, ModelTensors


@dataclass
class ShortConv:
    in_proj: Linear  # [3 * n_embd, n_embd]: B, C, x
    conv: torch.Tensor  # [n_embd, l_cache]
    out_proj: Linear  # [n_embd, n_embd]


@dataclass
class Lfm2Attention:
    wqkv: LinearGroup  # q [n_head * hd, n_embd], k and v [n_head_kv * hd, n_embd]
    wo: Linear  # [n_embd, n_head * hd]
    q_norm: torch.Tensor  # [hd]
    k_norm: torch.Tensor  # [hd]


@dataclass
class Lfm2Layer:
    attn_norm: torch.Tensor  # [n_embd]
    mixer: ShortConv | Lfm2Attention
    ffn_norm: torch.Tensor  # [n_embd]
    ffn_gate_up: LinearGroup  # gate, up [n_ff, n_embd]
    ffn_down: Linear  # [n_embd, n_ff]

    @classmethod
    def load(cls, t: ModelTensors, il: int, conv: bool, l_cache: Dim) -> Lfm2Layer:
        p, E, F = f"blk.{il}.", t.n_embd, t.n_ff(il)

        def w(name: str, shape: tuple[Dim, ...]) -> torch.Tensor:
            return t.tensor(p + name + ".weight", shape)

        mixer: ShortConv | Lfm2Attention
        if conv:
            mixer = ShortConv(
                t.linear(p + "shortconv.in_proj.weight", (3 * E, E)),
                w("shortconv.conv", (E, l_cache)),
                t.linear(p + "shortconv.out_proj.weight", (E, E)),
            )
        else:
            d = t.attention(il)
            norms = w("attn_q_norm", (d.head_k,)), w("attn_k_norm", (d.head_k,))
            mixer = Lfm2Attention(qkv(t, il, d), t.linear(p + "attn_output.weight", (E, d.out)), *norms)
        gate_up = t.group([(p + "ffn_gate.weight", (F, E)), (p + "ffn_up.weight", (F, E))])
        down = t.linear(p + "ffn_down.weight", (E, F))
        return cls(w("attn_norm", (E,)), mixer, w("ffn_norm", (E,)), gate_up, down)


class Lfm2Model:
    """Weights and forward pass of lfm2 (dense feed-forward layers)."""

    def __init__(self, t: ModelTensors) -> None:
        f, hp = t.f, t.hp
        self.hp, self.ops = hp, t.backend
        self.l_cache = read_int(f, f"{f.arch}.shortconv.l_cache", lo=2)
        if read_int(f, f"{f.arch}.attention.sliding_window", 0) > 0:
            raise ModelLoadError(f"{f.path.name}: lfm2 with sliding-window attention is not supported")
        E = t.n_embd
        self.tok_embd = t.embedding()  # [n_vocab, n_embd]
        self.output_norm = t.tensor("token_embd_norm.weight", (E,))  # the final norm, despite its name
        self.output = t.output(self.tok_embd)  # tied embeddings if absent
        l_cache = t.dim("shortconv.l_cache", self.l_cache)
        self.layers = [Lfm2Layer.load(t, il, self.is_recurrent(il), l_cache) for il in range(hp.n_layer)]
        self.rope = RopeParams(n_rot=hp.n_rot, base=hp.rope_base, freq_scale=hp.rope_freq_scale, neox=True)
        self.kq_scale = 1.0 / math.sqrt(hp.head_dim_k)

    def is_recurrent(self, il: int) -> bool:
        return self.hp.n_head_kv[il] == 0

    def memory_spec(self) -> HybridSpec:
        hp = self.hp
        attn = {
            il: KVLayerSpec(hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v)
            for il in range(hp.n_layer)
            if not self.is_recurrent(il)
        }
        # the convolution is the whole state: no SSM part
        conv = RSLayerSpec(conv_shape=(self.l_cache - 1, hp.n_embd), ssm_shape=(0,))
        recr = {il: conv for il in range(hp.n_layer) if self.is_recurrent(il)}
        return HybridSpec(KVSpec(attn, shift=self.rope_shift), RecurrentSpec(recr))

    def rope_shift(self, il: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Re-rotate cached K rows [n, n_head_kv, hd] by position deltas [n]."""
        return apply_rope(k, self.rope.rotation(delta), self.rope)

    def _short_conv(self, L: ShortConv, h: torch.Tensor, ub: UBatch, view: RSView) -> torch.Tensor:
        b, c, x = seq_blocks(L.in_proj(h), ub).chunk(3, dim=-1)  # [n_seqs, T, n_embd] each
        y, states = self.ops.short_conv(view.conv, b * x, L.conv, None, view.n_states)
        store(view, states, states.new_zeros(*states.shape[:2], 0))
        return L.out_proj((c * y).reshape(ub.n_tokens, -1))

    def _attention(
        self,
        il: int,
        A: Lfm2Attention,
        h: torch.Tensor,
        rot: Rotation,
        mctx: MemoryContext,
    ) -> torch.Tensor:
        hp, n = self.hp, h.shape[0]
        q, k, v = A.wqkv(h)
        q = q.view(n, hp.n_head, hp.head_dim_k)
        k = k.view(n, hp.n_head_kv[il], hp.head_dim_k)
        v = v.view(n, hp.n_head_kv[il], hp.head_dim_v)
        q = apply_rope(rms_norm(q, A.q_norm, hp.eps), rot, self.rope)
        k = apply_rope(rms_norm(k, A.k_norm, hp.eps), rot, self.rope)
        return A.wo(self.ops.attend(kv_view(mctx, il), q, k, v, self.kq_scale))

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """Logits [n_outputs, n_vocab] for the ubatch rows flagged as outputs, in row order."""
        hp = self.hp
        x = self.tok_embd(torch.from_numpy(ub.token))  # [n_tokens, n_embd]
        rot = self.rope.rotation(torch.from_numpy(ub.pos).to(x.device))
        for il, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, hp.eps)
            if isinstance(L.mixer, ShortConv):
                cur = self._short_conv(L.mixer, h, ub, rs_view(mctx, il))
            else:
                cur = self._attention(il, L.mixer, h, rot, mctx)
            if il == hp.n_layer - 1:  # only output rows need the rest
                out = torch.from_numpy(ub.output).to(x.device)
                cur, x = cur[out], x[out]
            x = x + cur
            x = x + swiglu(rms_norm(x, L.ffn_norm, hp.eps), L.ffn_gate_up, L.ffn_down)
        return linear_normed(self.output, x, self.output_norm, hp.eps, rms_norm)


ARCHITECTURES = {"lfm2": Lfm2Model}
