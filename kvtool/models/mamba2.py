"""The `mamba2` architecture (Mamba-2): per layer an RMS norm and an SSD mixer (one
in-projection to the gate z, x/B/C and dt per head, short causal conv over x/B/C, scan with a
scalar decay per head, D skip, SiLU gate, RMS norm per group, out-projection)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvtool.backend.linear import Linear
from kvtool.batch import UBatch
from kvtool.memory.recurrent import RecurrentSpec, RSLayerSpec, RSView
from kvtool.models.hparams import SSMHParams
from kvtool.models.layers import rms_norm
from kvtool.models.mamba_layers import RecurrentLM, seq_blocks, ssm_conv, store
from kvtool.models.tensors import ModelTensors

if TYPE_CHECKING:
    from kvtool.backend.ops import Backend


@dataclass
class Mamba2Layer:
    ssm_in: Linear  # [2 * d_inner + 2 * n_group * d_state + n_head, n_embd]
    conv_w: torch.Tensor  # [d_inner + 2 * n_group * d_state, d_conv]
    conv_b: torch.Tensor
    dt_b: torch.Tensor  # [n_head]
    A: torch.Tensor  # [n_head]
    D: torch.Tensor  # [n_head]
    norm: torch.Tensor | None  # [n_group, d_inner / n_group]
    ssm_out: Linear  # [n_embd, d_inner]

    @classmethod
    def load(cls, t: ModelTensors, il: int, s: SSMHParams) -> Mamba2Layer:
        p, E = f"blk.{il}.", t.n_embd
        di, dc = t.dim("ssm.inner_size", s.d_inner), t.dim("ssm.conv_kernel", s.d_conv)
        g, ds, h = (
            t.dim("ssm.group_count", s.n_group),
            t.dim("ssm.state_size", s.d_state),
            t.dim("ssm.time_step_rank", s.dt_rank),
        )
        gds = g * ds
        return cls(
            ssm_in=t.linear(p + "ssm_in.weight", (2 * di + 2 * gds + h, E)),
            conv_w=t.tensor(p + "ssm_conv1d.weight", (di + 2 * gds, dc)),
            conv_b=t.tensor(p + "ssm_conv1d.bias", (di + 2 * gds,)),
            dt_b=t.tensor(p + "ssm_dt.bias", numel=h),
            A=t.tensor(p + "ssm_a", numel=h).reshape(-1),
            D=t.tensor(p + "ssm_d", numel=h).reshape(-1),
            norm=t.optional(p + "ssm_norm.weight", (g, di // s.n_group)),
            ssm_out=t.linear(p + "ssm_out.weight", (E, di)),
        )


@dataclass(frozen=True)
class Mamba2Mixer:
    """The SSD mixer of a Mamba-2 layer (shared with hybrid models that have Mamba-2 layers)."""

    ssm: SSMHParams
    eps: float
    ops: Backend

    @property
    def n_head(self) -> int:
        return self.ssm.dt_rank

    @property
    def head_dim(self) -> int:
        return self.ssm.d_inner // self.ssm.dt_rank

    def layer_spec(self) -> RSLayerSpec:
        s = self.ssm
        return RSLayerSpec(
            conv_shape=(s.d_conv - 1, s.d_inner + 2 * s.n_group * s.d_state),
            ssm_shape=(self.n_head, self.head_dim, s.d_state),
        )

    def __call__(self, L: Mamba2Layer, h: torch.Tensor, ub: UBatch, view: RSView) -> torch.Tensor:
        """What layer L adds to the residual for the normed rows h [n_tokens, n_embd]."""
        s = self.ssm
        S, T = ub.n_seqs, ub.n_seq_tokens
        gn = s.n_group * s.d_state
        zxbcdt = seq_blocks(L.ssm_in(h), ub)
        z, xbc, dt = zxbcdt.split([s.d_inner, s.d_inner + 2 * gn, self.n_head], dim=-1)
        xbc, conv_states = ssm_conv(view.conv, xbc, L.conv_w, L.conv_b, view.n_states)
        xbc = F.silu(xbc)
        x, B, C = xbc.split([s.d_inner, gn, gn], dim=-1)
        x = x.reshape(S, T, self.n_head, self.head_dim)
        B = B.reshape(S, T, s.n_group, s.d_state)
        C = C.reshape(S, T, s.n_group, s.d_state)
        y, ssm_states = self.ops.ssd(view.ssm, x, dt + L.dt_b, L.A, B, C, view.n_states)
        store(view, conv_states, ssm_states)
        y = (y + x * L.D[:, None]).reshape(S, T, s.d_inner) * F.silu(z)
        if L.norm is not None:  # RMS norm within each group of channels
            y = rms_norm(y.view(S, T, s.n_group, -1), L.norm, self.eps).reshape(S, T, s.d_inner)
        return L.ssm_out(y.reshape(ub.n_tokens, -1))


class Mamba2Model(RecurrentLM):
    """Weights and forward pass of Mamba-2 (`ssm.time_step_rank` is the number of heads)."""

    def __init__(self, t: ModelTensors) -> None:
        super().__init__(t)
        self.hp = hp = t.hp
        self.ssm = s = SSMHParams.from_gguf(t.f)
        s.check_mamba2(t.f)
        self.mixer = Mamba2Mixer(s, hp.eps, t.backend)
        self.layers = [Mamba2Layer.load(t, il, s) for il in range(hp.n_layer)]

    def memory_spec(self) -> RecurrentSpec:
        return RecurrentSpec({il: self.mixer.layer_spec() for il in range(self.hp.n_layer)})

    def block(self, il: int, h: torch.Tensor, ub: UBatch, view: RSView) -> torch.Tensor:
        return self.mixer(self.layers[il], h, ub, view)


ARCHITECTURES = {"mamba2": Mamba2Model}
