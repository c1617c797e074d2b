"""The `gemma3` architecture (Gemma 3): scaled embeddings, q/k norms per head, post-attention and
post-FFN norms, GELU-gated FFN, NEOX RoPE with a base per layer kind, and interleaved sliding-window
attention (llama.cpp's llm_build_gemma3).

GGUF norm weights are stored "as used": the converter already added Gemma's +1, so every norm
is a plain RMSNorm multiply here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtool.batch import UBatch
from kvtool.gguf_file import GGUFFile
from kvtool.kernels.decoder_cpu import DecoderWeights, LayerWeights
from kvtool.memory.base import MemoryContext
from kvtool.memory.kv_cache import KVLayerSpec
from kvtool.memory.kv_cells import SWAParams
from kvtool.memory.spec import KVSpec
from kvtool.models.compiled import compiled_layers, decoder_weights, gate_up_pair, native, native_group
from kvtool.models.hparams import HParams, SWAHParams, read_float
from kvtool.models.inputs import ForwardInputs, forward_inputs
from kvtool.models.layers import attend, geglu, gelu_table, rms_norm
from kvtool.models.linear import Embedding, Linear, LinearGroup, load_linear, output_linear
from kvtool.models.rope import RopeParams, apply_rope

SWA_PATTERN_DEFAULT = 6  # five sliding layers, then one global (when the GGUF has no pattern key)
N_LAYER_27B = 62  # Gemma-3-27B scales queries by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim)


@dataclass
class Gemma3Layer:
    attn_norm: torch.Tensor  # [n_embd]
    wqkv: LinearGroup  # q [n_head * hd, n_embd], k [n_head_kv * hd, n_embd], v [n_head_kv * hd_v, n_embd]
    wo: Linear  # [n_embd, n_head * hd_v]
    q_norm: torch.Tensor  # [hd]
    k_norm: torch.Tensor  # [hd]
    attn_post_norm: torch.Tensor  # [n_embd]
    ffn_norm: torch.Tensor  # [n_embd]
    ffn_gate_up: LinearGroup  # gate, up [n_ff, n_embd]
    ffn_down: Linear  # [n_embd, n_ff]
    ffn_post_norm: torch.Tensor  # [n_embd]

    @classmethod
    def load(cls, f: GGUFFile, il: int, weights: str) -> Gemma3Layer:
        def t(name: str) -> torch.Tensor:
            return f.tensor(f"blk.{il}.{name}.weight")

        def lin(name: str) -> Linear:
            return load_linear(f, f"blk.{il}.{name}.weight", weights)

        def group(*names: str) -> LinearGroup:
            return LinearGroup(f, [f"blk.{il}.{n}.weight" for n in names], weights, [None] * len(names))

        return cls(
            attn_norm=t("attn_norm"),
            wqkv=group("attn_q", "attn_k", "attn_v"),
            wo=lin("attn_output"),
            q_norm=t("attn_q_norm"),
            k_norm=t("attn_k_norm"),
            attn_post_norm=t("post_attention_norm"),
            ffn_norm=t("ffn_norm"),
            ffn_gate_up=group("ffn_gate", "ffn_up"),
            ffn_down=lin("ffn_down"),
            ffn_post_norm=t("post_ffw_norm"),
        )


class Gemma3Model:
    """Weights and forward pass of the gemma3 architecture."""

    def __init__(self, f: GGUFFile, hp: HParams, weights: str = "auto") -> None:
        self.hp = hp
        self.swa = SWAHParams.from_gguf(f, hp.n_layer, SWA_PATTERN_DEFAULT)
        # Logits are soft-capped only when the file asks for it (Gemma 3 itself does not).
        self.final_logit_softcap = read_float(f, f"{f.arch}.final_logit_softcapping", 0.0)
        self.tok_embd = Embedding(f, "token_embd.weight", weights)  # [n_vocab, n_embd]
        self.output_norm = f.tensor("output_norm.weight")
        self.output = output_linear(f, weights, self.tok_embd)  # tied embeddings if absent
        self.layers = [Gemma3Layer.load(f, il, weights) for il in range(hp.n_layer)]
        self.rope_global = RopeParams(
            n_rot=hp.n_rot, base=hp.rope_base, freq_scale=hp.rope_freq_scale, neox=True
        )
        self.rope_swa = (
            RopeParams(
                n_rot=hp.n_rot, base=self.swa.rope_base, freq_scale=self.swa.rope_freq_scale, neox=True
            )
            if self.swa is not None
            else self.rope_global
        )
        head = hp.n_embd // hp.n_head if hp.n_layer == N_LAYER_27B else hp.head_dim_k
        self.q_scale = 1.0 / math.sqrt(head)
        self.embd_scale = math.sqrt(hp.n_embd)
        # the compiled call's ubatch views: one per kind of layer present (global, sliding)
        self._view_kinds = sorted({self.is_swa(il) for il in range(hp.n_layer)})
        self.decoder = self._decoder_weights()

    def is_swa(self, il: int) -> bool:
        return self.swa is not None and il in self.swa.layers

    def rope(self, il: int) -> RopeParams:
        """Sliding layers rotate with the SWA base (10000 unless `rope.freq_base_swa` says otherwise)."""
        return self.rope_swa if self.is_swa(il) else self.rope_global

    def memory_spec(self) -> KVSpec:
        hp = self.hp
        kv = {il: KVLayerSpec(hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v) for il in range(hp.n_layer)}
        if self.swa is None or not self.swa.layers:
            return KVSpec(kv, shift=self.rope_shift)
        return KVSpec(kv, shift=self.rope_shift, swa_layers=self.swa.layers, swa=SWAParams(self.swa.n_swa))

    def rope_shift(self, il: int, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Re-rotate cached K rows [n, n_head_kv, hd] of layer il by position deltas [n]."""
        p = self.rope(il)
        return apply_rope(k, p.rotation(delta), p)

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """Logits [n_outputs, n_vocab] for the ubatch rows flagged as outputs, in row order."""
        return self.compute(self.inputs(ub), ub, mctx)

    def inputs(self, ub: UBatch) -> ForwardInputs:
        """The ubatch's inputs on the model's device (kvtool/models/inputs.py)."""
        return forward_inputs(ub, self.output_norm.device, [self.rope_global, self.rope_swa])

    def compute(self, inp: ForwardInputs, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """`forward` from inputs on the device: no host data is read but the ubatch's shape."""
        hp = self.hp
        n = ub.n_tokens
        x = self.tok_embd(inp.token) * self.embd_scale  # [n, n_embd]
        rot_global = self.rope_global.rotation(inp.pos, inp.bounds)
        rot_swa = self.rope_swa.rotation(inp.pos, inp.bounds)
        cs = [(rot_swa if swa else rot_global).cs for swa in self._view_kinds]
        for il in range(compiled_layers(self.decoder, ub, mctx, x, cs), hp.n_layer):
            L = self.layers[il]
            rope = self.rope(il)
            rot = rot_swa if self.is_swa(il) else rot_global
            h = rms_norm(x, L.attn_norm, hp.eps)
            q, k, v = L.wqkv(h)
            q = q.reshape(n, hp.n_head, hp.head_dim_k)
            k = k.reshape(n, hp.n_head_kv[il], hp.head_dim_k)  # v stays rows [n, n_head_kv * hd_v]
            q = apply_rope(rms_norm(q, L.q_norm, hp.eps), rot, rope) * self.q_scale
            k = apply_rope(rms_norm(k, L.k_norm, hp.eps), rot, rope)
            a = L.wo(attend(mctx.layer_view(il), q, k, v, 1.0))  # queries are pre-scaled, as in llama.cpp
            if il == hp.n_layer - 1 and not ub.output.all():
                out = torch.from_numpy(ub.output).to(x.device)  # only output rows need the rest
                a, x = a[out], x[out]
            x += rms_norm(a, L.attn_post_norm, hp.eps)  # x is this forward's own tensor
            f = geglu(rms_norm(x, L.ffn_norm, hp.eps), L.ffn_gate_up, L.ffn_down)
            x += rms_norm(f, L.ffn_post_norm, hp.eps)
        logits = self.output(rms_norm(x, self.output_norm, hp.eps))
        if self.final_logit_softcap:
            c = self.final_logit_softcap
            logits = torch.tanh(logits / c) * c
        return logits

    def _decoder_weights(self) -> DecoderWeights | None:
        """The layers' description for the compiled decoder call (queries scaled inside the
        attention, GELU by `gelu_table`), or None where a layer's weights are not all in the
        compiled quantized kernel."""
        hp = self.hp
        parts = []
        for L in self.layers:
            qkv, wo, down = native_group(L.wqkv), native(L.wo), native(L.ffn_down)
            gu = gate_up_pair(L.ffn_gate_up)
            if qkv is None or len(qkv) not in (1, 3) or wo is None or gu is None or down is None:
                return None
            wk, wv = (qkv[1], qkv[2]) if len(qkv) == 3 else (None, None)
            post = {"attn_post_norm": L.attn_post_norm, "ffn_post_norm": L.ffn_post_norm}
            heads = {"q_norm": L.q_norm, "k_norm": L.k_norm}
            parts.append(LayerWeights(qkv[0], wo, gu, down, L.attn_norm, L.ffn_norm, wk, wv, **heads, **post))
        view = [self._view_kinds.index(self.is_swa(il)) for il in range(hp.n_layer)]
        return decoder_weights(
            parts, hp, n_rot=hp.n_rot, neox=True, scale=self.q_scale, view=view, gelu=gelu_table()
        )
