"""The `rwkv7` architecture (RWKV-7 "Goose"): one fused lerp for six mixes, LoRA-shaped decay,
in-context learning rate, value-residual and gate projections, the generalised delta rule
(WKV-7), the per-head "bonus" r.k term, and the squared-ReLU channel mix (llama.cpp's
llm_build_rwkv7). Every layer after the first mixes its values with the first layer's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.backend.linear import Linear, linear_rows
from kvtool.models.hparams import read_int
from kvtool.models.rwkv import Carry, RWKVModel, head_group_norm
from kvtool.models.tensors import Dim, ModelTensors, Shape

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
    wr: Linear  # [n_embd, n_embd]
    wk: Linear
    wv: Linear
    wo: Linear
    ln: torch.Tensor | None  # [n_embd]: group norm weight and bias (optional, as in llama.cpp)
    ln_b: torch.Tensor | None
    cm_lerp_k: torch.Tensor  # [n_embd]
    cm_key: Linear  # [n_ff, n_embd]
    cm_value: Linear  # [n_embd, n_ff]


_LORAS = (  # x of time_mix_{x}1 / {x}2 and the key of its rank
    ("w", "attention.decay_lora_rank"),
    ("a", "attention.iclr_lora_rank"),
    ("v", "attention.value_residual_mix_lora_rank"),
    ("g", "attention.gate_lora_rank"),
)


def _load_layer(t: ModelTensors, il: int, n_head: int) -> RWKV7Layer:
    p, f, E, F = f"blk.{il}.", t.f, t.n_embd, t.n_ff(il)
    ranks = {x: t.dim(key, read_int(f, f"{f.arch}.{key}", lo=1)) for x, key in _LORAS}
    ranks["v"] = (
        ranks["a"] if il == 0 else ranks["v"]
    )  # layer 0 has no value residual: llama.cpp sizes it as iclr

    def w(name: str, shape: Shape | None = None, numel: Dim | None = None) -> torch.Tensor:
        return t.tensor(p + name + ".weight", shape, numel)

    def vec(name: str) -> torch.Tensor:
        return w(name, numel=E).reshape(E.n)

    def lora(x: str, bias: bool = True) -> LoRA:
        r = ranks[x]
        return LoRA(
            w(f"time_mix_{x}1", (r, E)), w(f"time_mix_{x}2", (E, r)), vec(f"time_mix_{x}0") if bias else None
        )

    ln, ln_b = t.optional(p + "time_mix_ln.weight", (E,)), t.optional(p + "time_mix_ln.bias", (E,))
    has_ln = ln is not None and ln_b is not None  # llama.cpp uses the group norm's weights only in pairs
    return RWKV7Layer(
        lerp=w("time_mix_lerp_fused", numel=_N_LERPS * E).reshape(_N_LERPS, E.n),
        decay=lora("w"),
        iclr=lora("a"),
        value_mix=lora("v"),
        gate=lora("g", bias=False),
        k_k=vec("time_mix_k_k"),
        k_a=vec("time_mix_k_a"),
        r_k=w("time_mix_r_k", numel=E).reshape(n_head, -1),
        wr=t.linear(p + "time_mix_receptance.weight", (E, E)),
        wk=t.linear(p + "time_mix_key.weight", (E, E)),
        wv=t.linear(p + "time_mix_value.weight", (E, E)),
        wo=t.linear(p + "time_mix_output.weight", (E, E)),
        ln=ln if has_ln else None,
        ln_b=ln_b if has_ln else None,
        cm_lerp_k=vec("channel_mix_lerp_k"),
        cm_key=t.linear(p + "channel_mix_key.weight", (F, E)),
        cm_value=t.linear(p + "channel_mix_value.weight", (E, F)),
    )


class RWKV7Model(RWKVModel):
    """Weights and forward pass of the rwkv7 architecture."""

    def __init__(self, t: ModelTensors) -> None:
        super().__init__(t)
        self.layers = [_load_layer(t, il, self.rwkv.n_head) for il in range(t.hp.n_layer)]

    def time_mix(
        self, il: int, x: torch.Tensor, x_prev: torch.Tensor, state: torch.Tensor, carry: Carry, n_states: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.layers[il]
        B, T, E = x.shape
        H, N = self.rwkv.n_head, self.rwkv.head_size
        xr, xw, xk, xv, xa, xg = (x[:, :, None] + (x_prev - x)[:, :, None] * L.lerp).unbind(2)
        r = linear_rows(L.wr, xr)
        w_log = _DECAY_SCALE * torch.sigmoid(L.decay(xw, "tanh"))
        k = linear_rows(L.wk, xk)
        v = linear_rows(L.wv, xv)
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
        out, states = self.ops.wkv7(
            r.view(B, T, H, N), w_log.view(B, T, H, N), k4, v.view(B, T, H, N), -kk, kk * a4, state, n_states
        )
        out = out.reshape(B, T, E)
        if L.ln is not None and L.ln_b is not None:
            out = head_group_norm(out, L.ln, L.ln_b, N)
        bonus = (k4 * r.view(B, T, H, N) * L.r_k).sum(-1, keepdim=True) * v.view(B, T, H, N)
        out = (out + bonus.reshape(B, T, E)) * g
        return linear_rows(L.wo, out), states

    def channel_mix(self, il: int, x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
        L = self.layers[il]
        k = torch.relu(L.cm_key(x + (x_prev - x) * L.cm_lerp_k)).square()
        return L.cm_value(k)


ARCHITECTURES = {"rwkv7": RWKV7Model}
