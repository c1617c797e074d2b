"""The `rwkv6` architecture (RWKV-6 "Finch"): token shift with a data-dependent fused lerp,
data-dependent decay, WKV-6 with its per-head bonus `u`, per-head group norm, silu gate, and the
squared-ReLU channel mix with a receptance gate (llama.cpp's llm_build_rwkv6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.gguf_file import GGUFFile
from kvtool.kernels.wkv6 import wkv6
from kvtool.models.hparams import HParams
from kvtool.models.rwkv import Carry, RWKVModel, head_group_norm

_LERPS = ("w", "k", "v", "r", "g")  # the order of the fused lerp rows (and of time_mix_w1/w2)


@dataclass
class RWKV6Layer:
    lerp_x: torch.Tensor  # [n_embd]: the shift mix feeding the lerp LoRA
    lerp: torch.Tensor  # [5, n_embd]: static part of the w, k, v, r, g lerps
    mix_w1: torch.Tensor  # [5 * extra, n_embd]
    mix_w2: torch.Tensor  # [5, n_embd, extra]
    first: torch.Tensor  # [n_head, head_size]: the bonus u of the current token
    decay: torch.Tensor  # [n_embd]
    decay_w1: torch.Tensor  # [decay_extra, n_embd]
    decay_w2: torch.Tensor  # [n_embd, decay_extra]
    wk: torch.Tensor  # [n_embd, n_embd]
    wv: torch.Tensor
    wr: torch.Tensor
    wg: torch.Tensor
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    br: torch.Tensor | None
    ln: torch.Tensor  # [n_embd]: group norm weight and bias
    ln_b: torch.Tensor
    wo: torch.Tensor  # [n_embd, n_embd]
    cm_lerp_k: torch.Tensor  # [n_embd]
    cm_lerp_r: torch.Tensor
    cm_key: torch.Tensor  # [n_ff, n_embd]
    cm_value: torch.Tensor  # [n_embd, n_ff]
    cm_receptance: torch.Tensor  # [n_embd, n_embd]


def _opt(f: GGUFFile, name: str) -> torch.Tensor | None:
    return f.tensor(name) if f.has_tensor(name) else None


def _load_layer(f: GGUFFile, il: int, n_embd: int) -> RWKV6Layer:
    p = f"blk.{il}."

    def t(name: str) -> torch.Tensor:
        return f.tensor(p + name + ".weight")

    if f.has_tensor(p + "time_mix_lerp_fused.weight"):
        lerp = t("time_mix_lerp_fused").reshape(len(_LERPS), n_embd)
    else:  # older conversions store the five lerps apart
        lerp = torch.stack([t(f"time_mix_lerp_{n}").reshape(n_embd) for n in _LERPS])
    return RWKV6Layer(
        lerp_x=t("time_mix_lerp_x").reshape(n_embd),
        lerp=lerp,
        mix_w1=t("time_mix_w1"),
        mix_w2=t("time_mix_w2"),
        first=t("time_mix_first"),
        decay=t("time_mix_decay").reshape(n_embd),
        decay_w1=t("time_mix_decay_w1"),
        decay_w2=t("time_mix_decay_w2"),
        wk=t("time_mix_key"),
        wv=t("time_mix_value"),
        wr=t("time_mix_receptance"),
        wg=t("time_mix_gate"),
        bk=_opt(f, p + "time_mix_key.bias"),
        bv=_opt(f, p + "time_mix_value.bias"),
        br=_opt(f, p + "time_mix_receptance.bias"),
        ln=t("time_mix_ln"),
        ln_b=f.tensor(p + "time_mix_ln.bias"),
        wo=t("time_mix_output"),
        cm_lerp_k=t("channel_mix_lerp_k").reshape(n_embd),
        cm_lerp_r=t("channel_mix_lerp_r").reshape(n_embd),
        cm_key=t("channel_mix_key"),
        cm_value=t("channel_mix_value"),
        cm_receptance=t("channel_mix_receptance"),
    )


class RWKV6Model(RWKVModel):
    """Weights and forward pass of the rwkv6 architecture."""

    def __init__(self, f: GGUFFile, hp: HParams, weights: str = "auto") -> None:
        # Every weights mode loads float32 here: "auto" packs only the attention models' linears.
        super().__init__(f, hp)
        self.rescale_every_n_layers = self.rwkv.rescale_every_n_layers
        self.layers = [_load_layer(f, il, hp.n_embd) for il in range(hp.n_layer)]

    def time_mix(
        self, il: int, x: torch.Tensor, x_prev: torch.Tensor, state: torch.Tensor, carry: Carry, n_states: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.layers[il]
        B, T, E = x.shape
        H, N = self.rwkv.n_head, self.rwkv.head_size
        sx = x_prev - x
        h = torch.tanh(F.linear(x + sx * L.lerp_x, L.mix_w1)).view(B, T, len(_LERPS), -1)  # [B, T, 5, extra]
        lora = torch.einsum("btfd,fed->btfe", h, L.mix_w2)  # [B, T, 5, E]
        xw, xk, xv, xr, xg = (x[:, :, None] + (lora + L.lerp) * sx[:, :, None]).unbind(2)
        r = F.linear(xr, L.wr, L.br).view(B, T, H, N)
        k = F.linear(xk, L.wk, L.bk).view(B, T, H, N)
        v = F.linear(xv, L.wv, L.bv).view(B, T, H, N)
        g = F.silu(F.linear(xg, L.wg))
        # w = exp(-exp(d)): kept as its logarithm -exp(d), which the kernel exponentiates.
        w_log = -torch.exp(L.decay + F.linear(torch.tanh(F.linear(xw, L.decay_w1)), L.decay_w2))
        out, states = wkv6(r, k, v, w_log.view(B, T, H, N), L.first, state, n_states)
        out = head_group_norm(out.reshape(B, T, E), L.ln, L.ln_b, N) * g
        return F.linear(out, L.wo), states

    def channel_mix(self, il: int, x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
        L = self.layers[il]
        sx = x_prev - x
        r = torch.sigmoid(F.linear(x + sx * L.cm_lerp_r, L.cm_receptance))
        k = torch.relu(F.linear(x + sx * L.cm_lerp_k, L.cm_key)).square()
        return r * F.linear(k, L.cm_value)
