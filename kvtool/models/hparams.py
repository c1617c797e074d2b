"""Hyper-parameters read from a GGUF's `{arch}.*` keys."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile


def per_layer(value: object, n_layer: int) -> list[int]:
    """A key that is either one number or an array with one value per layer."""
    if isinstance(value, np.ndarray | list):
        vals = [int(v) for v in value]
        if len(vals) != n_layer:
            raise ModelLoadError(f"per-layer array of length {len(vals)} for {n_layer} layers")
        return vals
    return [int(value)] * n_layer  # type: ignore[call-overload]


@dataclass(frozen=True)
class HParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: list[int]
    head_dim_k: int
    head_dim_v: int
    eps: float
    rope_base: float
    n_rot: int
    rope_freq_scale: float

    @classmethod
    def from_gguf(cls, f: GGUFFile, n_vocab: int) -> HParams:
        n_embd = int(f.arch_get("embedding_length"))
        n_layer = int(f.arch_get("block_count"))
        n_head = int(f.arch_get("attention.head_count"))
        n_head_kv = per_layer(f.arch_get("attention.head_count_kv", n_head), n_layer)
        hd_k = int(f.arch_get("attention.key_length", n_embd // n_head if n_head else 0))  # 0: no attention
        hd_v = int(f.arch_get("attention.value_length", hd_k))
        scaling = str(f.arch_get("rope.scaling.type", "none"))
        factor = float(f.arch_get("rope.scaling.factor", 0.0) or 0.0)
        if scaling not in ("none", "linear") and factor not in (0.0, 1.0):
            raise ModelLoadError(f"unsupported rope scaling '{scaling}'")
        freq_scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
        return cls(
            arch=f.arch,
            n_vocab=int(f.arch_get("vocab_size", n_vocab)),
            n_ctx_train=int(f.arch_get("context_length", 4096)),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=int(np.max(f.arch_get("feed_forward_length"))),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=hd_k,
            head_dim_v=hd_v,
            eps=float(f.arch_get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(f.arch_get("rope.freq_base", 10000.0)),
            n_rot=int(f.arch_get("rope.dimension_count", hd_k)),
            rope_freq_scale=freq_scale,
        )


def swa_layers_from_pattern(pattern: object, n_layer: int) -> frozenset[int]:
    """Sliding-window layers from `attention.sliding_window_pattern` (llama_hparams::set_swa_pattern):
    a number n makes layer il sliding iff il % n < n - 1 (n = 0: every layer); an array gives
    one flag per layer (true = sliding)."""
    if isinstance(pattern, np.ndarray | list):
        flags = [bool(v) for v in pattern]
        if len(flags) != n_layer:
            raise ModelLoadError(f"sliding_window_pattern has {len(flags)} flags for {n_layer} layers")
        return frozenset(il for il, f in enumerate(flags) if f)
    n = int(pattern)  # type: ignore[call-overload]
    return frozenset(il for il in range(n_layer) if n == 0 or il % n < n - 1)


@dataclass(frozen=True)
class SWAHParams:
    """Interleaved sliding-window attention: the window, which layers use it, and the rope those
    layers use (llama.cpp's rope_freq_base_train_swa / rope_freq_scale_train_swa)."""

    n_swa: int
    layers: frozenset[int]
    rope_base: float
    rope_freq_scale: float = 1.0

    @classmethod
    def from_gguf(
        cls, f: GGUFFile, n_layer: int, default_pattern: int, default_rope_base: float = 10000.0
    ) -> SWAHParams | None:
        """None when the file has no (or a zero) `attention.sliding_window`: no layer slides."""
        n_swa = int(f.arch_get("attention.sliding_window", 0) or 0)
        if n_swa <= 0:
            return None
        pattern = f.arch_get("attention.sliding_window_pattern", default_pattern)
        return cls(
            n_swa=n_swa,
            layers=swa_layers_from_pattern(pattern, n_layer),
            rope_base=float(f.arch_get("rope.freq_base_swa", default_rope_base)),
        )


_SSM_KEYS = ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank")


@dataclass(frozen=True)
class SSMHParams:
    """Mamba's `{arch}.ssm.*` keys. For Mamba-2, `dt_rank` is the number of heads (llama.cpp
    reuses time_step_rank for it) and `n_group` the number of B/C groups."""

    d_conv: int
    d_inner: int
    d_state: int
    dt_rank: int
    n_group: int
    dt_b_c_rms: bool  # FalconMamba: RMS-norm dt, B and C

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> SSMHParams:
        missing = [k for k in _SSM_KEYS if f.get(f"{f.arch}.{k}", None) is None]
        if missing:
            raise ModelLoadError(f"{f.path.name}: missing GGUF key {f.arch}.{missing[0]}")
        hp = cls(
            d_conv=int(f.arch_get("ssm.conv_kernel")),
            d_inner=int(f.arch_get("ssm.inner_size")),
            d_state=int(f.arch_get("ssm.state_size")),
            dt_rank=int(f.arch_get("ssm.time_step_rank")),
            n_group=int(f.arch_get("ssm.group_count", 1) or 1),
            dt_b_c_rms=bool(f.arch_get("ssm.dt_b_c_rms", False)),
        )
        if min(hp.d_conv, hp.d_inner, hp.d_state, hp.dt_rank) < 1:
            raise ModelLoadError(f"{f.path.name}: ssm dimensions must be positive")
        return hp


@dataclass(frozen=True)
class GraniteScales:
    """Granite's scalars (llama.cpp's f_embedding_scale, f_residual_scale, f_logit_scale,
    f_attention_scale); 0 means absent: no scaling, and 1/sqrt(head_dim) for attention."""

    embedding: float
    residual: float
    logit: float
    attention: float

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> GraniteScales:
        def get(key: str) -> float:
            return float(f.arch_get(key, 0.0) or 0.0)

        return cls(get("embedding_scale"), get("residual_scale"), get("logit_scale"), get("attention.scale"))
