"""Quantized matmul on CPU over GGUF blocks as they lie in the file (qmatmul.c, via cpu_lib).

y = x @ W.T the way llama.cpp's CPU backend computes it: each row of x is quantized to the
activation type ggml pairs with W's format (its `vec_dot_type`): Q8_0 (int8 per block of 32,
scale max|x| / 127 stored as a half) for Q4_0, Q5_0 and Q8_0; Q8_1 (Q8_0 and the block's d * sum
as a half) for Q4_1, whose offset m comes in through it; Q8_K (int8 per 256, scale -max / 127 of
the largest |x| with its sign, a float) for the K-quants and IQ4_XS; IQ4_NL takes Q8_0. Each
weight block's integer dot product with it is scaled by both scales. `qmatmul_ref` is that
specification in torch; the C kernel computes the same integer sums and differs only in the order
of float additions (on AVX2 its order is ggml's vec_dot's, so a row has the bits llama.cpp
computes).

No compiler or a failed build means `available()` is False and callers keep another path
(kernels/cpu_lib.py builds and loads the C kernels).
"""

from __future__ import annotations

import ctypes

import torch

from kvtool.kernels import cpu_lib
from kvtool.kernels.dequant import (
    IQ4_NL,
    IQ4_XS,
    Q2_K,
    Q3_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_K,
    Q6_K,
    Q8_0,
    QK_K,
    dequantize,
)

# type id -> (elements per block, bytes per block)
BLOCKS = {
    Q4_0: (32, 18),
    Q4_1: (32, 20),
    Q5_0: (32, 22),
    Q8_0: (32, 34),
    Q4_K: (QK_K, 144),
    Q5_K: (QK_K, 176),
    Q6_K: (QK_K, 210),
    Q2_K: (QK_K, 84),
    Q3_K: (QK_K, 110),
    IQ4_XS: (QK_K, 136),
    IQ4_NL: (32, 18),
}
K_QUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)  # their activations are Q8_K
MAX_SEGS = 8  # weights one call stacks (qmatmul.c's MAX_SEGS)
LOWBIT_TYPES = (Q2_K, Q3_K, IQ4_XS, IQ4_NL)  # no panel kernel, no float copy (QWeight.panels)


def supported(qtype: int, shape: tuple[int, ...]) -> bool:
    """Whether a 2-D weight of GGML type `qtype` and numpy shape (N, K) has a kernel."""
    b = BLOCKS.get(int(qtype))
    return b is not None and len(shape) == 2 and shape[1] % b[0] == 0


def panels(qtype: int) -> bool:
    """Whether many-row calls of this format (prompts: qmatmul.c's PANEL_MIN_ROWS and more) have
    the panel kernel in the loaded build; without it they are best left to a dense GEMM."""
    lib = _lib()
    return lib is not None and bool(lib.kvq_panels(int(qtype)))


def _lib() -> ctypes.CDLL | None:
    return cpu_lib.lib()


def available() -> bool:
    """Whether the compiled kernels loaded on this machine."""
    return cpu_lib.lib() is not None


class _Weight(ctypes.Structure):  # qmatmul.c's kvq_weight
    _fields_ = [
        ("type", ctypes.c_int),
        ("nseg", ctypes.c_int),
        ("ws", ctypes.POINTER(ctypes.c_void_p)),
        ("seg_rows", ctypes.POINTER(ctypes.c_int64)),
        ("row_bytes", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("n_out", ctypes.c_int64),
    ]


class QWeight:
    """One or more GGUF weights of one type and width, stacked along n_out (Q, K and V in one
    call), kept as the raw block bytes they are in the file. Calling it needs `available()`."""

    def __init__(self, raws: list[torch.Tensor], qtype: int, shapes: list[tuple[int, int]]) -> None:
        if not raws or len(raws) > MAX_SEGS or len(raws) != len(shapes):
            raise ValueError(f"qmatmul takes 1 to {MAX_SEGS} weights")
        k = shapes[0][1]
        if any(not supported(qtype, s) or s[1] != k for s in shapes):
            raise ValueError(f"type id {qtype} with shapes {shapes} has no qmatmul kernel")
        elems, size = BLOCKS[int(qtype)]
        self.qtype, self.k = int(qtype), k
        self.n_out = sum(s[0] for s in shapes)
        self.row_bytes = k // elems * size
        self._raws = [r.reshape(-1).view(torch.uint8) for r in raws]  # kept alive: C reads them
        for r, s in zip(self._raws, shapes, strict=True):
            if r.numel() != s[0] * self.row_bytes:
                raise ValueError(f"{r.numel()} bytes do not hold a weight of shape {s}")
        self._ptrs = (ctypes.c_void_p * len(raws))(*(r.data_ptr() for r in self._raws))
        self._rows = (ctypes.c_int64 * len(raws))(*(s[0] for s in shapes))
        self._nseg = len(raws)
        self._desc = _Weight(self.qtype, self._nseg, self._ptrs, self._rows, self.row_bytes, k, self.n_out)
        self._desc_ptr = ctypes.addressof(self._desc)
        # many rows (prompts) stay in the compiled kernel: the formats with its panel kernel are
        # fast there, and the low-bit ones' float copy would be 7-12x their bytes (7B Q2_K: 28 GB)
        self.panels = panels(self.qtype) or self.qtype in LOWBIT_TYPES

    def __call__(
        self, x: torch.Tensor, lib: ctypes.CDLL | None = None, norm: tuple[torch.Tensor, float] | None = None
    ) -> torch.Tensor:
        """x [n, K] float32 -> x @ W.T [n, N] float32 (with `lib`, another build of the kernel).
        `norm` = (w [K] float32, eps): each row RMS-normed and scaled by w first."""
        lib = lib or _lib()
        assert lib is not None
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"qmatmul: x of shape {tuple(x.shape)} for weights of width {self.k}")
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        n = x.shape[0]
        y = torch.empty(n, self.n_out)
        if norm is None:
            rc = lib.kvq_matmul_w(self._desc_ptr, x.data_ptr(), x.stride(0), n, y.data_ptr())
        else:
            w = _norm_weight(norm[0], self.k)
            rc = lib.kvq_matmul_norm(
                self._desc_ptr, x.data_ptr(), x.stride(0), n, y.data_ptr(), w.data_ptr(), norm[1]
            )
        if rc != 0:
            raise ValueError(f"qmatmul: bad call (type {self.qtype}, K {self.k}, x {tuple(x.shape)})")
        return y


def _norm_weight(w: torch.Tensor, k: int) -> torch.Tensor:
    if w.dtype != torch.float32 or not w.is_contiguous() or w.numel() != k:
        if w.numel() != k:
            raise ValueError(f"a norm weight of {w.numel()} for rows of {k}")
        w = w.float().contiguous()
    return w


def ffn_glu(
    x: torch.Tensor,
    gate_up: QWeight,
    down: QWeight,
    lib: ctypes.CDLL | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    gelu: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) in one call, `gate_up` stacking the gate then the up weight,
    x first RMS-normed and scaled by norm = (w, eps) if given; the hidden rows are quantized like
    any activation. act is silu, or with `gelu` (float32 [65536], the activation of each half's
    bits) the gate rounded to a half and looked up, except gate <= -10 -> 0, >= 10 -> gate
    (ggml's CPU GELU: kvtool/models/layers.py's gelu_table)."""
    lib = lib or _lib()
    assert lib is not None
    if x.dim() != 2 or x.shape[1] != gate_up.k or gate_up.n_out != 2 * down.k:
        raise ValueError(f"ffn_glu: x {tuple(x.shape)}, gate/up {gate_up.n_out}x{gate_up.k}, down K {down.k}")
    if gelu is not None and (gelu.dtype != torch.float32 or gelu.shape != (65536,) or gelu.stride(0) != 1):
        raise ValueError("ffn_glu: the GELU table is 65536 contiguous float32 values")
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    y = torch.empty(x.shape[0], down.n_out)
    w = _norm_weight(norm[0], gate_up.k) if norm is not None else None
    args = (w.data_ptr() if w is not None else None, norm[1] if norm is not None else 0.0)
    table = gelu.data_ptr() if gelu is not None else None
    if lib.kvq_ffn_glu(
        gate_up._desc_ptr, down._desc_ptr, x.data_ptr(), x.stride(0), x.shape[0], y.data_ptr(), *args, table
    ):
        raise ValueError("ffn_glu: bad call")
    return y


def qmatmul(x: torch.Tensor, w: torch.Tensor, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """x [n, K] float32 @ W.T -> [n, N] float32 for one weight's raw bytes `w` of type `qtype`
    and numpy shape (N, K). Needs `available()`."""
    return QWeight([w], qtype, [shape])(x)


# -------------------------------------------------------------------------------- specification


def quantize_q8_0_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, K] -> (q [n, K/32, 32] int values as float, d [n, K/32, 1]) as ggml's x86
    quantize_row_q8_0: q = round(x * 127 / amax) (ties to even), d = amax / 127 rounded to a half."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(xb * inv), (amax / 127.0).half().float()


def quantize_q8_1_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_1: Q8_0's (q, d) and s [n, K/32, 1] = (amax / 127) * sum(q), rounded to a half."""
    q, d = quantize_q8_0_ref(x)
    amax = x.float().reshape(x.shape[0], -1, 32).abs().amax(-1, keepdim=True)
    return q, d, ((amax / 127.0) * q.sum(-1, keepdim=True)).half().float()


def quantize_q8_K_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, K] -> (q [n, K/256, 256], d [n, K/256, 1]) as ggml's quantize_row_q8_K_ref: with
    max the first element of the largest |x| (its sign kept), q = round(-127 / max * x) (ties
    to even), d = 1 / (-127 / max); an all-zero block has d = 0."""
    xb = x.float().reshape(x.shape[0], -1, QK_K)
    mx = torch.gather(xb, -1, xb.abs().argmax(-1, keepdim=True))
    iscale = torch.where(mx != 0, -127.0 / mx, torch.zeros_like(mx))
    q = torch.round(iscale * xb).clamp(max=127)
    return q, torch.where(mx != 0, 1.0 / iscale, torch.zeros_like(mx))


def qmatmul_ref(x: torch.Tensor, w: torch.Tensor, qtype: int, shape: tuple[int, int]) -> torch.Tensor:
    """The specification: the activations quantized for the format times the exactly dequantized
    weights, in float64 (Q4_1: its offsets times the activations' s instead of d * sum(q))."""
    n = x.shape[0]
    wd = dequantize(w, qtype, shape).double()
    if qtype in K_QUANTS:
        q, d = quantize_q8_K_ref(x)
        return ((q.double() * d.double()).reshape(n, -1) @ wd.T).float()
    if qtype != Q4_1:
        q, d = quantize_q8_0_ref(x)
        return ((q.double() * d.double()).reshape(n, -1) @ wd.T).float()
    q, d, s = quantize_q8_1_ref(x)
    m = w.reshape(-1).view(torch.uint8).view(-1, 20)[:, 2:4].contiguous().view(torch.float16)
    m = m.double().reshape(shape[0], -1)  # [N, K/32]: each block's offset
    offset = (s - d * q.sum(-1, keepdim=True)).squeeze(-1).double()  # [n, K/32]
    return ((q.double() * d.double()).reshape(n, -1) @ wd.T + offset @ m.T).float()


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml's RMS norm (each square a float, their sum in float64), then the weight."""
    mean = (x.float().pow(2).double().sum(-1, keepdim=True) / x.shape[-1]).float()
    return (x * (1.0 / torch.sqrt(mean + eps))) * w


def ffn_swiglu_ref(
    x: torch.Tensor,
    gate_up: list[tuple[torch.Tensor, tuple[int, int]]],
    down: tuple[torch.Tensor, tuple[int, int]],
    qtypes: tuple[int, int],
) -> torch.Tensor:
    """The specification of `ffn_glu` with silu: raw (bytes, shape) of gate, up and down, their types."""
    (g_raw, g_shape), (u_raw, u_shape) = gate_up
    g = qmatmul_ref(x, g_raw, qtypes[0], g_shape)
    u = qmatmul_ref(x, u_raw, qtypes[0], u_shape)
    return qmatmul_ref(torch.nn.functional.silu(g) * u, down[0], qtypes[1], down[1])
