"""The `rwkv6` architecture (RWKV-6 "Finch"): token shift with a data-dependent fused lerp,
data-dependent decay, WKV-6 with its per-head bonus `u`, per-head group norm, silu gate, and the
squared-ReLU channel mix with a receptance gate (llama.cpp's llm_build_rwkv6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.backend.linear import Linear, linear_rows
from kvtool.models.hparams import RWKVHParams, read_int
from kvtool.models.rwkv import Carry, RWKVModel, head_group_norm
from kvtool.models.tensors import Dim, ModelTensors, Shape

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
    wk: Linear  # [n_embd, n_embd] (+ optional bias)
    wv: Linear
    wr: Linear
    wg: Linear
    ln: torch.Tensor  # [n_embd]: group norm weight and bias
    ln_b: torch.Tensor
    wo: Linear  # [n_embd, n_embd]
    cm_lerp_k: torch.Tensor  # [n_embd]
    cm_lerp_r: torch.Tensor
    cm_key: Linear  # [n_ff, n_embd]
    cm_value: Linear  # [n_embd, n_ff]
    cm_receptance: Linear  # [n_embd, n_embd]


def _load_layer(t: ModelTensors, il: int, r: RWKVHParams) -> RWKV6Layer:
    p, f, E, F = f"blk.{il}.", t.f, t.n_embd, t.n_ff(il)
    extra = t.dim("time_mix_extra_dim", read_int(f, f"{f.arch}.time_mix_extra_dim", lo=1))
    dextra = t.dim("time_decay_extra_dim", read_int(f, f"{f.arch}.time_decay_extra_dim", lo=1))
    hs = t.dim("wkv.head_size", r.head_size)

    def w(name: str, shape: Shape | None = None, numel: Dim | None = None) -> torch.Tensor:
        return t.tensor(p + name + ".weight", shape, numel)

    def lin(name: str, shape: Shape, bias: bool = False) -> Linear:
        return t.linear(p + name + ".weight", shape, p + name + ".bias" if bias else None)

    def vec(name: str) -> torch.Tensor:
        return w(name, numel=E).reshape(E.n)

    if t.has(p + "time_mix_lerp_fused.weight"):
        lerp = w("time_mix_lerp_fused", numel=len(_LERPS) * E).reshape(len(_LERPS), E.n)
    else:  # older conversions store the five lerps apart
        lerp = torch.stack([vec(f"time_mix_lerp_{n}") for n in _LERPS])
    return RWKV6Layer(
        lerp_x=vec("time_mix_lerp_x"),
        lerp=lerp,
        mix_w1=w("time_mix_w1", (len(_LERPS) * extra, E)),
        mix_w2=w("time_mix_w2", (len(_LERPS), E, extra)),
        first=w("time_mix_first", (Dim(r.n_head, E.keys + hs.keys), hs)),
        decay=vec("time_mix_decay"),
        decay_w1=w("time_mix_decay_w1", (dextra, E)),
        decay_w2=w("time_mix_decay_w2", (E, dextra)),
        wk=lin("time_mix_key", (E, E), bias=True),
        wv=lin("time_mix_value", (E, E), bias=True),
        wr=lin("time_mix_receptance", (E, E), bias=True),
        wg=lin("time_mix_gate", (E, E)),
        ln=w("time_mix_ln", (E,)),
        ln_b=t.tensor(p + "time_mix_ln.bias", (E,)),
        wo=lin("time_mix_output", (E, E)),
        cm_lerp_k=vec("channel_mix_lerp_k"),
        cm_lerp_r=vec("channel_mix_lerp_r"),
        cm_key=lin("channel_mix_key", (F, E)),
        cm_value=lin("channel_mix_value", (E, F)),
        cm_receptance=lin("channel_mix_receptance", (E, E)),
    )


class RWKV6Model(RWKVModel):
    """Weights and forward pass of the rwkv6 architecture."""

    def __init__(self, t: ModelTensors) -> None:
        super().__init__(t)
        self.rescale_every_n_layers = self.rwkv.rescale_every_n_layers
        self.layers = [_load_layer(t, il, self.rwkv) for il in range(t.hp.n_layer)]

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
        r = linear_rows(L.wr, xr).view(B, T, H, N)
        k = linear_rows(L.wk, xk).view(B, T, H, N)
        v = linear_rows(L.wv, xv).view(B, T, H, N)
        g = F.silu(linear_rows(L.wg, xg))
        # w = exp(-exp(d)): kept as its logarithm -exp(d), which the kernel exponentiates.
        w_log = -torch.exp(L.decay + F.linear(torch.tanh(F.linear(xw, L.decay_w1)), L.decay_w2))
        out, states = self.ops.wkv6(r, k, v, w_log.view(B, T, H, N), L.first, state, n_states)
        out = head_group_norm(out.reshape(B, T, E), L.ln, L.ln_b, N) * g
        return linear_rows(L.wo, out), states

    def channel_mix(self, il: int, x: torch.Tensor, x_prev: torch.Tensor) -> torch.Tensor:
        L = self.layers[il]
        sx = x_prev - x
        r = torch.sigmoid(L.cm_receptance(x + sx * L.cm_lerp_r))
        k = torch.relu(L.cm_key(x + sx * L.cm_lerp_k)).square()
        return r * L.cm_value(k)


ARCHITECTURES = {"rwkv6": RWKV6Model}
