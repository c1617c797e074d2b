"""The Gemma family: `gemma3` (Gemma 3) here, `gemma2` (kvtool/models/gemma2.py) by its `Variant`.
Scaled embeddings, pre- and post-norms around attention and the FFN, GELU-gated FFN, NEOX RoPE with
a base per layer kind, interleaved sliding-window attention; Gemma 3 norms Q and K per head,
Gemma 2 soft-caps the attention scores and the logits (llama.cpp's llm_build_gemma3 and
llm_build_gemma2).

GGUF norm weights are stored "as used": the converter already added Gemma's +1, so every norm
is a plain RMSNorm multiply here. Every tensor is named and shaped once, where it is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtool.backend.linear import Linear, LinearGroup
from kvtool.batch import UBatch
from kvtool.memory.base import MemoryContext
from kvtool.memory.spec import KVSpec
from kvtool.memory.views import kv_view
from kvtool.models.hparams import SWAHParams, read_float
from kvtool.models.inputs import ForwardInputs, forward_inputs
from kvtool.models.kv_layers import KVLayers
from kvtool.models.layers import DecoderLayer, DecoderOptions, geglu, gelu_table
from kvtool.models.llama import qkv
from kvtool.models.rope import RopeParams, apply_rope
from kvtool.models.tensors import Dim, ModelTensors

N_LAYER_27B = {
    "gemma2": 46,
    "gemma3": 62,
}  # 27B scales queries by 1/sqrt(n_embd / n_head), not 1/sqrt(head_dim)

if TYPE_CHECKING:  # the backend imports the models' building blocks
    from kvtool.backend.ops import Decoder


@dataclass(frozen=True)
class Variant:
    """What Gemma 2 and Gemma 3 do differently (llama.cpp's load_arch_hparams of each)."""

    qk_norm: bool  # Q and K RMS-normed per head (Gemma 3)
    swa_pattern: int  # the sliding-window pattern when the GGUF has none
    n_swa: int  # the window when the GGUF has none; 0: no sliding layers then
    swa_rope_base: (
        float | None
    )  # the sliding layers' rope base without `rope.freq_base_swa` (None: rope.freq_base)
    attn_softcap: float | None  # attention scores soft-capped at `attn_logit_softcapping`, or this default
    final_softcap: float  # logits soft-capped at `final_logit_softcapping`, or this default (0: not)


GEMMA3 = Variant(
    qk_norm=True, swa_pattern=6, n_swa=0, swa_rope_base=10000.0, attn_softcap=None, final_softcap=0.0
)


@dataclass
class Gemma3Layer:
    attn_norm: torch.Tensor  # [n_embd]
    wqkv: LinearGroup  # q [n_head * hd, n_embd], k [n_head_kv * hd, n_embd], v [n_head_kv * hd_v, n_embd]
    wo: Linear  # [n_embd, n_head * hd_v]
    q_norm: torch.Tensor | None  # [hd] (Gemma 3)
    k_norm: torch.Tensor | None  # [hd]
    attn_post_norm: torch.Tensor  # [n_embd]
    ffn_norm: torch.Tensor  # [n_embd]
    ffn_gate_up: LinearGroup  # gate, up [n_ff, n_embd]
    ffn_down: Linear  # [n_embd, n_ff]
    ffn_post_norm: torch.Tensor  # [n_embd]

    @classmethod
    def load(cls, t: ModelTensors, il: int, v: Variant) -> Gemma3Layer:
        p, E, F = f"blk.{il}.", t.n_embd, t.n_ff(il)
        d = t.attention(il)

        def norm(name: str, size: Dim = E) -> torch.Tensor:
            return t.tensor(p + name + ".weight", (size,))

        return cls(
            attn_norm=norm("attn_norm"),
            wqkv=qkv(t, il, d),
            wo=t.linear(p + "attn_output.weight", (E, d.out)),
            q_norm=norm("attn_q_norm", d.head_k) if v.qk_norm else None,
            k_norm=norm("attn_k_norm", d.head_k) if v.qk_norm else None,
            attn_post_norm=norm("post_attention_norm"),
            ffn_norm=norm("ffn_norm"),
            ffn_gate_up=t.group([(p + "ffn_gate.weight", (F, E)), (p + "ffn_up.weight", (F, E))]),
            ffn_down=t.linear(p + "ffn_down.weight", (E, F)),
            ffn_post_norm=norm("post_ffw_norm"),
        )


class Gemma3Model:
    """Weights and forward pass of an architecture of the Gemma family."""

    def __init__(self, t: ModelTensors, variant: Variant = GEMMA3) -> None:
        f, hp, v = t.f, t.hp, variant
        self.hp, self.v, self.ops = hp, v, t.backend
        a = f.arch + "."
        swa_base = v.swa_rope_base if v.swa_rope_base is not None else hp.rope_base
        self.swa = SWAHParams.from_gguf(f, hp.n_layer, v.swa_pattern, swa_base, v.n_swa)
        self.attn_softcap = 0.0
        if v.attn_softcap is not None:
            self.attn_softcap = read_float(f, a + "attn_logit_softcapping", v.attn_softcap, positive=True)
        # Logits are soft-capped only when the file (or the variant's default) asks for it.
        self.final_logit_softcap = read_float(f, a + "final_logit_softcapping", v.final_softcap)
        self.tok_embd = t.embedding()  # [n_vocab, n_embd]
        self.output_norm = t.tensor("output_norm.weight", (t.n_embd,))
        self.output = t.output(self.tok_embd)  # tied embeddings if absent
        self.layers = [Gemma3Layer.load(t, il, v) for il in range(hp.n_layer)]
        rope_global = RopeParams(n_rot=hp.n_rot, base=hp.rope_base, freq_scale=hp.rope_freq_scale, neox=True)
        rope_swa = rope_global
        if self.swa is not None:
            rope_swa = RopeParams(
                n_rot=hp.n_rot, base=self.swa.rope_base, freq_scale=self.swa.rope_freq_scale, neox=True
            )
        self.kv = KVLayers(hp, self.swa, rope_global, rope_swa)
        head = hp.n_embd // hp.n_head if hp.n_layer == N_LAYER_27B.get(f.arch) else hp.head_dim_k
        self.q_scale = 1.0 / math.sqrt(head)
        self.embd_scale = math.sqrt(hp.n_embd)
        self.decoder = self._decoder()

    def is_swa(self, il: int) -> bool:
        return self.kv.is_swa(il)

    def rope(self, il: int) -> RopeParams:
        """Sliding layers rotate with the SWA base (Gemma 3: 10000 unless `rope.freq_base_swa` says
        otherwise)."""
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
        hp = self.hp
        n = ub.n_tokens
        x = self.tok_embd(inp.token) * self.embd_scale  # [n, n_embd]
        rots = self.kv.rotations(inp)
        cs = [rots[swa].cs for swa in self.kv.kinds]
        for il in range(self.ops.decoder_layers(self.decoder, ub, mctx, x, cs), hp.n_layer):
            L = self.layers[il]
            rope = self.rope(il)
            rot = rots[self.is_swa(il)]
            h = self.ops.rms_norm_ggml(x, L.attn_norm, hp.eps)
            q, k, v = L.wqkv(h)
            q = q.reshape(n, hp.n_head, hp.head_dim_k)
            k = k.reshape(n, hp.n_head_kv[il], hp.head_dim_k)  # v stays rows [n, n_head_kv * hd_v]
            if L.q_norm is not None and L.k_norm is not None:
                q, k = (
                    self.ops.rms_norm_ggml(q, L.q_norm, hp.eps),
                    self.ops.rms_norm_ggml(k, L.k_norm, hp.eps),
                )
            q = apply_rope(q, rot, rope) * self.q_scale
            k = apply_rope(k, rot, rope)
            # queries are pre-scaled, as in llama.cpp
            a = L.wo(self.ops.attend(kv_view(mctx, il), q, k, v, 1.0, softcap=self.attn_softcap))
            if il == hp.n_layer - 1 and not ub.output.all():
                out = torch.from_numpy(ub.output).to(x.device)  # only output rows need the rest
                a, x = a[out], x[out]
            x += self.ops.rms_norm_ggml(a, L.attn_post_norm, hp.eps)  # x is this forward's own tensor
            f = geglu(self.ops.rms_norm_ggml(x, L.ffn_norm, hp.eps), L.ffn_gate_up, L.ffn_down)
            x += self.ops.rms_norm_ggml(f, L.ffn_post_norm, hp.eps)
        logits = self.output(self.ops.rms_norm_ggml(x, self.output_norm, hp.eps))
        if self.final_logit_softcap:
            c = self.final_logit_softcap
            logits = torch.tanh(logits / c) * c
        return logits

    def _decoder(self) -> Decoder | None:
        """The layers' description for the compiled decoder call (queries scaled after the RoPE
        as `compute` does, GELU by `gelu_table`; None: op by op)."""
        layers = [DecoderLayer(L, softcap=self.attn_softcap) for L in self.layers]
        opts = DecoderOptions(self.hp.n_rot, True, 1.0, self.kv.views(), gelu_table(), self.q_scale)
        return self.ops.decoder(layers, self.hp, opts)


ARCHITECTURES = {"gemma3": Gemma3Model}
