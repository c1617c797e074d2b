"""Building blocks shared by the architectures: norms and feed-forward (RoPE is
kvtool/models/rope.py; attention over the KV cache and ggml's RMS norm are the backend's ops,
kvtool/backend)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from kvtool.backend.linear import Linear, LinearGroup, glu_native


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * w / sqrt(mean(x^2) + eps) over the last dim (ggml_rms_norm then a multiply).

    One torch op, bit-identical in float32 to the spelled-out formula; a weight that is not
    one value per element of the last dim (Mamba-2's per-group norm) is broadcast after."""
    if w is None or w.shape == x.shape[-1:]:
        return torch.rms_norm(x, x.shape[-1:], w, eps)
    return torch.rms_norm(x, x.shape[-1:], None, eps) * w


def swiglu(x: torch.Tensor, gate_up: LinearGroup, down: Linear) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); one call of the compiled kernel where the backend put both
    weights in it and the rows fit it (kvtool/backend/linear.py's `glu_native`)."""
    y = glu_native(x, gate_up, down)
    if y is not None:
        return y
    gate, up = gate_up(x)
    return down(F.silu(gate) * up)


def swiglu_normed(
    x: torch.Tensor, w: torch.Tensor, eps: float, gate_up: LinearGroup, down: Linear
) -> torch.Tensor:
    """swiglu(rms_norm(x, w, eps)), the norm inside the compiled call where that applies."""
    y = glu_native(x, gate_up, down, norm=(w, eps))
    return y if y is not None else swiglu(rms_norm(x, w, eps), gate_up, down)


_SQRT_2_OVER_PI = 0.79788456080286535587989211986876
_GELU_COEF_A = 0.044715


def _gelu_half(xh: torch.Tensor) -> torch.Tensor:
    """tanh-GELU of half values (as float32), evaluated in float32 and rounded to a half."""
    g = 0.5 * xh * (1.0 + torch.tanh(_SQRT_2_OVER_PI * xh * (1.0 + _GELU_COEF_A * xh * xh)))
    return g.to(torch.float16).float()


def gelu_ggml(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU as ggml computes it on CPU (GGML_GELU_FP16): x is rounded to fp16 and the result
    looked up in an fp16 table of tanh-GELU, except x <= -10 -> 0 and x >= 10 -> x. Rounding in and
    out of fp16 around an f32 evaluation reproduces the table. On the tiny gemma3 oracle model this
    brings kvtool 2-5x closer to llama.cpp than exact tanh-GELU (max rel 1.3e-4 instead of 3.9e-4)."""
    g = _gelu_half(x.to(torch.float16).float())
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, g))


@functools.cache
def gelu_table() -> torch.Tensor:
    """`gelu_ggml`'s value for every half, by its bits ([65536] float32; ±10 and beyond are the
    caller's): the compiled feed-forward rounds the gate to a half and looks it up, as ggml does."""
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    return _gelu_half(halves.float()).contiguous()


def geglu(x: torch.Tensor, gate_up: LinearGroup, down: Linear) -> torch.Tensor:
    """down(gelu(gate(x)) * up(x)) with ggml's CPU GELU (llama.cpp's LLM_FFN_GELU + LLM_FFN_PAR):
    one call of the compiled kernel with `gelu_table`, as `swiglu`'s."""
    y = glu_native(x, gate_up, down, gelu=gelu_table())
    if y is not None:
        return y
    gate, up = gate_up(x)
    return down(gelu_ggml(gate) * up)


class DecoderBlock(Protocol):
    """The parts of a decoder layer the compiled call takes, by the names the llama and Gemma
    layers give them (kernels/decoder_cpu.py's `LayerWeights` says what each is)."""

    @property
    def wqkv(self) -> LinearGroup: ...
    @property
    def wo(self) -> Linear: ...
    @property
    def ffn_gate_up(self) -> LinearGroup: ...
    @property
    def ffn_down(self) -> Linear: ...
    @property
    def attn_norm(self) -> torch.Tensor | None: ...
    @property
    def ffn_norm(self) -> torch.Tensor | None: ...
    @property
    def q_norm(self) -> torch.Tensor | None: ...
    @property
    def k_norm(self) -> torch.Tensor | None: ...
    @property
    def attn_post_norm(self) -> torch.Tensor | None: ...
    @property
    def ffn_post_norm(self) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class DecoderLayer:
    """A model's decoder layer for the compiled call, with its options: `qkv_bias`, Q/K/V may
    carry biases (qwen2), else a bias anywhere keeps the model op by op; Q/K normed over the whole
    projection (`qk_norm_all`, olmo2), a residual scale (granite), an attention soft-cap (Gemma 2)."""

    block: DecoderBlock
    qkv_bias: bool = False
    qk_norm_all: bool = False
    res_scale: float = 0.0
    softcap: float = 0.0


@dataclass(frozen=True)
class DecoderOptions:
    """The compiled decoder call's shape beyond the layers: RoPE (`n_rot`, `neox`), the scale of
    the scores, which view each layer attends with (None: one), ggml's GELU table (None: SwiGLU)
    and Q's scale after the RoPE (Gemma's ggml_scale of Qcur)."""

    n_rot: int
    neox: bool
    scale: float
    view: Sequence[int] | None = None
    gelu: torch.Tensor | None = None
    q_scale: float = 1.0
