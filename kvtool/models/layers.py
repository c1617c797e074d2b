"""Building blocks shared by the architectures: norms, RoPE, feed-forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvtool.kernels.attention import attention, attention_cells
from kvtool.kernels.store_kv import store_kv
from kvtool.memory.kv_cache_context import KVView
from kvtool.models.linear import Linear, LinearGroup


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * w / sqrt(mean(x^2) + eps) over the last dim (ggml_rms_norm then a multiply)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


_ROPE_TABLE_MAX = 1 << 17  # positions beyond are computed directly, not tabled


@dataclass(frozen=True)
class RopeParams:
    """llama.cpp's rope: `n_rot` dims rotated; NORM rotates adjacent pairs (2i, 2i+1),
    NEOX rotates (i, i + n_rot/2). theta_i = pos * freq_scale * base^(-2i/n_rot) / factor_i."""

    n_rot: int
    base: float
    freq_scale: float = 1.0
    neox: bool = False
    freq_factors: torch.Tensor | None = None  # [n_rot/2] (rope_freqs.weight), divides theta
    # cos/sin per position 0..len-1, computed once and grown by doubling: the same float64
    # arithmetic as `_cos_sin`, so a table row is bit-identical to computing it afresh
    _table: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, compare=False, repr=False)

    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # in float64 on the CPU whatever the device, so that every device rotates alike
        half = self.n_rot // 2
        inv = self.base ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.n_rot)
        if self.freq_factors is not None:
            inv = inv / self.freq_factors.cpu().double()
        theta = pos.cpu().double()[:, None] * self.freq_scale * inv[None, :]
        return torch.cos(theta).float().to(pos.device), torch.sin(theta).float().to(pos.device)

    def cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, n_rot/2] for positions (or position deltas) `pos` [n], on pos's device."""
        if pos.numel() == 0 or int(pos.min()) < 0:  # negative deltas (seq_add): computed directly
            return self._cos_sin(pos)
        top = int(pos.max())
        if top >= _ROPE_TABLE_MAX:
            return self._cos_sin(pos)
        table = self._table[0] if self._table else None
        if table is None or top >= table[0].shape[0] or table[0].device != pos.device:
            size = max(256, 1 << top.bit_length(), 0 if table is None else table[0].shape[0])
            self._table[:] = [self._cos_sin(torch.arange(size, device=pos.device))]
        cos, sin = self._table[0]
        return cos[pos], sin[pos]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: RopeParams) -> torch.Tensor:
    """x [n, n_head, head_dim]; cos/sin [n, n_rot/2]. Dims past n_rot pass through."""
    half = p.n_rot // 2
    c, s = cos[:, None, :], sin[:, None, :]  # [n, 1, half]
    xr, rest = x[..., : p.n_rot], x[..., p.n_rot :]
    if p.neox:
        a, b = xr[..., :half], xr[..., half:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def swiglu(x: torch.Tensor, gate_up: LinearGroup, down: Linear) -> torch.Tensor:
    """down(silu(gate(x)) * up(x))."""
    gate, up = gate_up(x)
    return down(F.silu(gate) * up)


_SQRT_2_OVER_PI = 0.79788456080286535587989211986876
_GELU_COEF_A = 0.044715


def gelu_ggml(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU as ggml computes it on CPU (GGML_GELU_FP16): x is rounded to fp16 and the result
    looked up in an fp16 table of tanh-GELU, except x <= -10 -> 0 and x >= 10 -> x. Rounding in and
    out of fp16 around an f32 evaluation reproduces the table. On the tiny gemma3 oracle model this
    brings kvtool 2-5x closer to llama.cpp than exact tanh-GELU (max rel 1.3e-4 instead of 3.9e-4)."""
    xh = x.to(torch.float16).float()
    g = 0.5 * xh * (1.0 + torch.tanh(_SQRT_2_OVER_PI * xh * (1.0 + _GELU_COEF_A * xh * xh)))
    g = g.to(torch.float16).float()
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, g))


def geglu(x: torch.Tensor, gate_up: LinearGroup, down: Linear) -> torch.Tensor:
    """down(gelu(gate(x)) * up(x)) with ggml's CPU GELU (llama.cpp's LLM_FFN_GELU + LLM_FFN_PAR)."""
    gate, up = gate_up(x)
    return down(gelu_ggml(gate) * up)


def attend(view: KVView, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Stores the ubatch's K/V rows in the layer's cache, then attends per stream.

    q [n, n_head, d_k], k [n, n_head_kv, d_k], v [n, n_head_kv, d_v] -> [n, n_head * d_v].
    The cache is read in its own type (f16/bf16/f32): the kernel upcasts inside."""
    n = q.shape[0]
    kc, vc = view.k, view.v  # [n_stream, n_cells, n_head_kv, d]
    store_kv(kc.view(-1, kc.shape[2] * kc.shape[3]), k.reshape(n, -1), view.rows)
    store_kv(vc.view(-1, vc.shape[2] * vc.shape[3]), v.reshape(n, -1), view.rows)
    n_s = view.streams.stop - view.streams.start
    qs = q.reshape(n_s, n // n_s, q.shape[1], q.shape[2])  # [n_stream_ub, n / n_stream_ub, n_head, d_k]
    ks = kc[view.streams, : view.n_kv]  # [n_stream_ub, n_kv, n_head_kv, d_k]
    vs = vc[view.streams, : view.n_kv]
    if view.cells is not None:  # on CUDA: the kernel decides visibility from the cells
        return attention_cells(qs, ks, vs, view.cells, scale).reshape(n, -1)
    assert view.mask is not None
    return attention(qs, ks, vs, view.mask, scale).reshape(n, -1)
