"""Hyper-parameters read from a GGUF's `{arch}.*` keys.

Every read is typed and range-checked here: a key of the wrong type, a count that is zero or
negative, a NaN epsilon or a per-layer array of the wrong length is a one-line ModelLoadError
naming the key and its value. kvtool/models/hparams_check.py then checks the values against the
tensors' shapes, so that nothing is left to fail at the first decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile

_MISSING = object()


def _show(value: object) -> str:
    if isinstance(value, np.ndarray | list):
        return f"an array of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def bad_key(f: GGUFFile, key: str, value: object, why: str) -> ModelLoadError:
    """The one-line error for a key whose value is unusable: `file: key = value: why`."""
    return ModelLoadError(f"{f.path.name}: {key} = {_show(value)}: {why}")


def read_int(f: GGUFFile, key: str, default: object = _MISSING, lo: int | None = None) -> int:
    """An integer key (full name), at least `lo`; a missing key takes `default` (if given)."""
    value = f.get(key) if default is _MISSING else f.get(key, default)
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iub":
        value = value.reshape(-1)[0]  # a one-element array is a number
    if not isinstance(value, int | np.integer):  # bool is an int
        raise bad_key(f, key, value, "not an integer")
    if lo is not None and value < lo:
        raise bad_key(f, key, value, f"must be at least {lo}")
    return int(value)


def read_float(f: GGUFFile, key: str, default: object = _MISSING, positive: bool = False) -> float:
    """A finite real key (full name); `positive`: it must be > 0."""
    value = f.get(key) if default is _MISSING else f.get(key, default)
    if not isinstance(value, int | float | np.integer | np.floating):
        raise bad_key(f, key, value, "not a number")
    x = float(value)
    if not math.isfinite(x):
        raise bad_key(f, key, value, "not finite")
    if positive and x <= 0:
        raise bad_key(f, key, value, "must be positive")
    return x


def per_layer(f: GGUFFile, key: str, value: object, n_layer: int, lo: int = 0) -> list[int]:
    """A key that is either one number or an array with one value per layer (each >= `lo`)."""
    if isinstance(value, np.ndarray | list):
        if len(value) != n_layer:
            raise bad_key(f, key, value, f"a per-layer array needs {n_layer} values (block_count)")
        if not (isinstance(value, np.ndarray) and value.dtype.kind in "iub"):
            raise bad_key(f, key, value, "not an array of integers")
        vals = [int(v) for v in value]
    elif isinstance(value, int | np.integer):
        vals = [int(value)] * n_layer
    else:
        raise bad_key(f, key, value, "not an integer or an array of integers")
    if min(vals) < lo:
        raise bad_key(f, key, min(vals), f"must be at least {lo} in every layer")
    return vals


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
    rope_attn_factor: float = 1.0  # cos and sin scaled by it (llama.cpp's rope_attn_factor)

    @classmethod
    def from_gguf(cls, f: GGUFFile, n_vocab: int) -> HParams:
        a = f.arch + "."
        n_embd = read_int(f, a + "embedding_length", lo=1)
        n_layer = read_int(f, a + "block_count", lo=1)
        # every block has tensors: a larger count is a corrupt file (and must not size the lists below)
        n_tensors = len(f.tensor_names())
        if n_layer > n_tensors:
            raise bad_key(f, a + "block_count", n_layer, f"more blocks than the file's {n_tensors} tensors")
        n_head = read_int(f, a + "attention.head_count", 0, lo=0)
        n_head_kv = per_layer(
            f, a + "attention.head_count_kv", f.get(a + "attention.head_count_kv", n_head), n_layer
        )
        hd_k = read_int(
            f, a + "attention.key_length", n_embd // n_head if n_head else 0, lo=0
        )  # 0: no attention
        hd_v = read_int(f, a + "attention.value_length", hd_k, lo=0)
        scaling = f.get(a + "rope.scaling.type", "none")
        factor = read_float(f, a + "rope.scaling.factor", 0.0)
        if scaling not in ("none", "linear") and factor not in (0.0, 1.0):
            raise bad_key(f, a + "rope.scaling.type", scaling, "unsupported rope scaling")
        if factor < 0:
            raise bad_key(f, a + "rope.scaling.factor", factor, "must not be negative")
        freq_scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
        n_ff = per_layer(f, a + "feed_forward_length", f.get(a + "feed_forward_length"), n_layer)
        return cls(
            arch=f.arch,
            n_vocab=read_int(f, a + "vocab_size", n_vocab, lo=1) if f.has(a + "vocab_size") else n_vocab,
            n_ctx_train=read_int(f, a + "context_length", 4096, lo=1),
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=max(n_ff),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=hd_k,
            head_dim_v=hd_v,
            eps=read_float(f, a + "attention.layer_norm_rms_epsilon", 1e-5, positive=True),
            rope_base=read_float(f, a + "rope.freq_base", 10000.0, positive=True),
            n_rot=read_int(f, a + "rope.dimension_count", hd_k, lo=0),
            rope_freq_scale=freq_scale,
            rope_attn_factor=read_float(f, a + "rope.scaling.attn_factor", 1.0, positive=True),
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
        cls,
        f: GGUFFile,
        n_layer: int,
        default_pattern: int,
        default_rope_base: float = 10000.0,
        default_n_swa: int = 0,
    ) -> SWAHParams | None:
        """None when the window, `attention.sliding_window` (or `default_n_swa` without it), is
        0: no layer slides."""
        a = f.arch + "."
        n_swa = read_int(f, a + "attention.sliding_window", default_n_swa, lo=0)
        if n_swa == 0:
            return None
        key = a + "attention.sliding_window_pattern"
        pattern = f.get(key, default_pattern)
        if isinstance(pattern, np.ndarray | list):
            if not (isinstance(pattern, np.ndarray) and pattern.dtype.kind in "iub"):
                raise bad_key(f, key, pattern, "not an array of flags")
        else:
            pattern = read_int(f, key, default_pattern, lo=0)
        return cls(
            n_swa=n_swa,
            layers=swa_layers_from_pattern(pattern, n_layer),
            rope_base=read_float(f, a + "rope.freq_base_swa", default_rope_base, positive=True),
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
        a = f.arch + "."
        d_conv, d_inner, d_state, dt_rank = (read_int(f, a + k, lo=1) for k in _SSM_KEYS)
        return cls(
            d_conv=d_conv,
            d_inner=d_inner,
            d_state=d_state,
            dt_rank=dt_rank,
            n_group=read_int(f, a + "ssm.group_count", 1, lo=0) or 1,
            dt_b_c_rms=bool(read_int(f, a + "ssm.dt_b_c_rms", False)),
        )

    def check_mamba2(self, f: GGUFFile) -> None:
        """Mamba-2 splits the inner size into heads (time_step_rank) and the heads into groups."""
        a = f.arch + "."
        if self.d_inner % self.dt_rank:
            raise bad_key(
                f, a + "ssm.time_step_rank", self.dt_rank, f"does not divide ssm.inner_size {self.d_inner}"
            )
        if self.dt_rank % self.n_group:
            raise bad_key(
                f, a + "ssm.group_count", self.n_group, f"does not divide ssm.time_step_rank {self.dt_rank}"
            )


@dataclass(frozen=True)
class RWKVHParams:
    """RWKV-6/7 keys (`{arch}.wkv.head_size`...): heads are n_embd / head_size, norms are
    layer norms with `attention.layer_norm_epsilon`."""

    head_size: int
    n_head: int
    norm_eps: float
    rescale_every_n_layers: int  # RWKV-6: halve the residual after every n-th layer (0: never)

    @classmethod
    def from_gguf(cls, f: GGUFFile, n_embd: int) -> RWKVHParams:
        a = f.arch + "."
        head_size = read_int(f, a + "wkv.head_size", lo=1)
        if n_embd % head_size:
            raise bad_key(f, a + "wkv.head_size", head_size, f"does not divide embedding_length {n_embd}")
        shifts = read_int(f, a + "token_shift_count", 2)
        if shifts != 2:
            raise bad_key(f, a + "token_shift_count", shifts, "only 2 is supported, as in llama.cpp")
        return cls(
            head_size=head_size,
            n_head=n_embd // head_size,
            norm_eps=read_float(f, a + "attention.layer_norm_epsilon", 1e-5, positive=True),
            rescale_every_n_layers=read_int(f, a + "rescale_every_n_layers", 0, lo=0),
        )


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
            return read_float(f, f"{f.arch}.{key}", 0.0)

        return cls(get("embedding_scale"), get("residual_scale"), get("logit_scale"), get("attention.scale"))
