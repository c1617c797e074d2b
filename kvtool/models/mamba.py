"""The `mamba` architecture (Mamba-1, FalconMamba): per layer an RMS norm and a selective-scan
mixer (in-projection to x and gate z, short causal conv, data-dependent dt/B/C, scan, D skip,
SiLU gate, out-projection); no feed-forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.backend.linear import Linear, linear_rows
from kvtool.batch import UBatch
from kvtool.memory.recurrent import RecurrentSpec, RSLayerSpec, RSView
from kvtool.models.hparams import SSMHParams
from kvtool.models.layers import rms_norm
from kvtool.models.mamba_layers import RecurrentLM, seq_blocks, ssm_conv, store
from kvtool.models.tensors import ModelTensors


@dataclass
class MambaLayer:
    ssm_in: Linear  # [2 * d_inner, n_embd]
    conv_w: torch.Tensor  # [d_inner, d_conv]
    conv_b: torch.Tensor  # [d_inner]
    ssm_x: Linear  # [dt_rank + 2 * d_state, d_inner]
    ssm_dt: Linear  # [d_inner, dt_rank] (+ bias [d_inner])
    A: torch.Tensor  # [d_inner, d_state] (already -exp(A_log))
    D: torch.Tensor  # [d_inner]
    ssm_out: Linear  # [n_embd, d_inner]
    dt_norm: torch.Tensor | None
    b_norm: torch.Tensor | None
    c_norm: torch.Tensor | None


class MambaModel(RecurrentLM):
    """Weights and forward pass of Mamba-1."""

    def __init__(self, t: ModelTensors) -> None:
        super().__init__(t)
        self.hp = hp = t.hp
        self.ssm = s = SSMHParams.from_gguf(t.f)
        E, di, dc = t.n_embd, t.dim("ssm.inner_size", s.d_inner), t.dim("ssm.conv_kernel", s.d_conv)
        ds, dt = t.dim("ssm.state_size", s.d_state), t.dim("ssm.time_step_rank", s.dt_rank)

        def layer(il: int) -> MambaLayer:
            p = f"blk.{il}."
            t.check(p + "ssm_dt.bias", (di,))  # required, as llama.cpp's
            return MambaLayer(
                ssm_in=t.linear(p + "ssm_in.weight", (2 * di, E)),
                conv_w=t.tensor(p + "ssm_conv1d.weight", (di, dc)),
                conv_b=t.tensor(p + "ssm_conv1d.bias", (di,)),
                ssm_x=t.linear(p + "ssm_x.weight", (dt + 2 * ds, di)),
                ssm_dt=t.linear(p + "ssm_dt.weight", (di, dt), p + "ssm_dt.bias"),
                A=t.tensor(p + "ssm_a", (di, ds)),
                D=t.tensor(p + "ssm_d", (di,)),
                ssm_out=t.linear(p + "ssm_out.weight", (E, di)),
                dt_norm=t.optional(p + "ssm_dt_norm.weight", (dt,)),
                b_norm=t.optional(p + "ssm_b_norm.weight", (ds,)),
                c_norm=t.optional(p + "ssm_c_norm.weight", (ds,)),
            )

        self.layers = [layer(il) for il in range(hp.n_layer)]

    def memory_spec(self) -> RecurrentSpec:
        s = self.ssm
        spec = RSLayerSpec(conv_shape=(s.d_conv - 1, s.d_inner), ssm_shape=(s.d_inner, s.d_state))
        return RecurrentSpec({il: spec for il in range(self.hp.n_layer)})

    def block(self, il: int, h: torch.Tensor, ub: UBatch, view: RSView) -> torch.Tensor:
        s, L = self.ssm, self.layers[il]
        xz = seq_blocks(L.ssm_in(h), ub)  # [n_seqs, T, 2 * d_inner]
        x, z = xz[..., : s.d_inner], xz[..., s.d_inner :]
        x, conv_states = ssm_conv(view.conv, x, L.conv_w, L.conv_b, view.n_states)
        x = F.silu(x)
        dbc = linear_rows(L.ssm_x, x)  # [n_seqs, T, dt_rank + 2 * d_state]
        dt, B, C = dbc.split([s.dt_rank, s.d_state, s.d_state], dim=-1)
        if s.dt_b_c_rms or (L.dt_norm is not None and L.b_norm is not None and L.c_norm is not None):
            dt, B, C = (rms_norm(t, w, self.eps) for t, w in ((dt, L.dt_norm), (B, L.b_norm), (C, L.c_norm)))
        dt = linear_rows(L.ssm_dt, dt)  # [n_seqs, T, d_inner]
        y, ssm_states = self.ops.ssm_scan(view.ssm, x, dt, L.A, B, C, view.n_states)
        store(view, conv_states, ssm_states)
        y = (y + x * L.D) * F.silu(z)
        return L.ssm_out(y.reshape(ub.n_tokens, -1))


ARCHITECTURES = {"mamba": MambaModel}
