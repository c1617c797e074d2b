"""The `rwkv7` architecture (RWKV-7 "Goose"): one fused lerp for six mixes, LoRA-shaped decay,
in-context learning rate, value-residual and gate projections, the generalised delta rule
(WKV-7), the per-head "bonus" r.k term, and the squared-ReLU channel mix (llama.cpp's
llm_build_rwkv7). Every layer after the first mixes its values with the first layer's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.gguf_file import GGUFFile
from kvtool.kernels.wkv7 import wkv7
from kvtool.models.hparams import HParams
from kvtool.models.rwkv import Carry, RWKVModel, head_group_norm

_N_LERPS = 6  # r, w, k, v, a, g: the rows of the fused lerp
_DECAY_SCALE = -0.606531  # w = exp(-0.606531 * sigmoid(x)) = exp(-e^-0.5 * sigmoid(x))
_L2_EPS = 1e-12


@dataclass
class LoRA:
    """x -> w2 @ act(w1 @ x) (+ w0): RWKV-7's low-rank projections."""

    w1: torch.Tensor  # [rank, n_embd]
    w2: torch.Tensor  # [n_embd, rank]
    w0: torch.Tensor | None = None  # [n_embd]

    def __call__(self, x: torch.Tensor, act: str | None = None) -> torch.Tensor:
        h = F.linear(x, self.w1)
        if act == "tanh":
            h = torch.tanh(h)
        elif act == "sigmoid":
            h = torch.sigmoid(h)
        y = F.linear(h, self.w2)
        return y + self.w0 if self.w0 is not None else y


@dataclass
class RWKV7Layer:
    lerp: torch.Tensor  # [6, n_embd]
    decay: LoRA  # w0, w1, w2
    iclr: LoRA  # a0, a1, a2: the in-context learning rate
    value_mix: LoRA  # v0, v1, v2: how much of the first layer's value to take (unused in layer 0)
    gate: LoRA  # g1, g2 (no bias)
    k_k: torch.Tensor  # [n_embd]
    k_a: torch.Tensor
    r_k: torch.Tensor  # [n_head, head_size]
    wr: torch.Tensor  # [n_embd, n_embd]
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ln: torch.Tensor | None  # [n_embd]: group norm weight and bias (optional, as in llama.cpp)
    ln_b: torch.Tensor | None
    cm_lerp_k: torch.Tensor  # [n_embd]
    cm_key: torch.Tensor  # [n_ff, n_embd]
    cm_value: torch.Tensor  # [n_embd, n_ff]


def _load_layer(f: GGUFFile, il: int, n_embd: int, n_head: int) -> RWKV7Layer:
    p = f"blk.{il}."

    def t(name: str) -> torch.Tensor:
        return f.tensor(p + name + ".weight")

    def vec(name: str) -> torch.Tensor:
        return t(name).reshape(n_embd)

    def lora(x: str, bias: bool = True) -> LoRA:
        return LoRA(t(f"time_mix_{x}1"), t(f"time_mix_{x}2"), vec(f"time_mix_{x}0") if bias else None)

    has_ln = f.has_tensor(p + "time_mix_ln.weight") and f.has_tensor(p + "time_mix_ln.bias")
    return RWKV7Layer(
        lerp=t("time_mix_lerp_fused").reshape(_N_LERPS, n_embd),
        decay=lora("w"),
        iclr=lora("a"),
        value_mix=lora("v"),
        gate=lora("g", bias=False),
        k_k=vec("time_mix_k_k"),
        k_a=vec("time_mix_k_a"),
        r_k=t("time_mix_r_k").reshape(n_head, -1),
        wr=t("time_mix_receptance"),
        wk=t("time_mix_key"),
        wv=t("time_mix_value"),
        wo=t("time_mix_output"),
        ln=t("time_mix_ln") if has_ln else None,
        ln_b=f.tensor(p + "time_mix_ln.bias") if has_ln else None,
        cm_lerp_k=vec("channel_mix_lerp_k"),
        cm_key=t("channel_mix_key"),
        cm_value=t("channel_mix_value"),
    )


class RWKV7Model(RWKVModel):
    """Weights and forward pass of the rwkv7 architecture."""

    def __init__(self, f: GGUFFile, hp: HParams, weights: str = "auto") -> None:
        # Every weights mode loads float32 here: "auto" packs only the attention models' linears.
        super().__init__(f, hp)
        self.layers = [_load_layer(f, il, hp.n_embd, self.rwkv.n_head) for il in range(hp.n_layer)]

    def time_mix(
        self, il: int, x: torch.Tensor, x_prev: torch.Tensor, state: torch.Tensor, carry: Carry, n_states: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.layers[il]
        B, T, E = x.shape
        H, N = self.rwkv.n_head, self.rwkv.head_size
        xr, xw, xk, xv, xa, xg = (x[:, :, None] + (x_prev - x)[:, :, None] * L.lerp).unbind(2)
        r = F.linear(xr, L.wr)
        w_log = _DECAY_SCALE * torch.sigmoid(L.decay(xw, "tanh"))
        k = F.linear(xk, L.wk)
        v = F.linear(xv, L.wv)
        if carry.v_first is None:
            carry.v_first = v
        else:
            v = v + (carry.v_first - v) * torch.sigmoid(L.value_mix(xv))
        g = L.gate(xg, "sigmoid")
        a = torch.sigmoid(L.iclr(xa))
        kk = F.normalize((k * L.k_k).view(B, T, H, N), dim=-1, eps=_L2_EPS)
        ka = k * L.k_a
        k = k + (a * ka - ka)
        k4, a4 = k.view(B, T, H, N), a.view(B, T, H, N)
        out, states = wkv7(
            r.view(B, T, H, N), w_log.view(B, T, H, N), k4, v.view(B, T, H, N), -kk, kk * a4, state, n_states
        )
        out = out.reshape(B, T, E)
        if L.ln is not None and L.ln_b is not None:
            out = head_group_norm(out, L.ln, L.ln_b, N)
        bonus = (k4 * r.view(B, T, H, N) * L.r_k).sum(-1, keepdim=True) * v.view(B, T, H, N)
        out = (out + bonus.reshape(B, T, E)) * g
        return F.linear(out, L.wo), states

    def channel_mix(self, il: int, x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
        L = self.layers[il]
        k = torch.relu(F.linear(x + (x_prev - x) * L.cm_lerp_k, L.cm_key)).square()
        return F.linear(k, L.cm_value)
