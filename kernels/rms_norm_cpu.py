"""RMS norm of float32 rows on the CPU with ggml's arithmetic (rms_norm_cpu.c via cpu_lib): the
norm the compiled decoder call applies, so that a forward norming op by op gives its bits.
`kvtool.kernels.qmatmul.rms_norm_ref` is the specification."""

from __future__ import annotations

import ctypes

import torch

from kvtool.kernels import cpu_lib


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `rms_norm_cpu` takes these: float32 rows on the CPU, one weight per column."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() >= 1
        and w.shape == x.shape[-1:]
        and cpu_lib.lib() is not None
    )


def rms_norm_cpu(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., width] RMS-normed over the last dim, times w [width], in a new tensor."""
    lib = cpu_lib.lib()
    assert lib is not None
    f = lib.kvn_rms_norm
    if f.argtypes is None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        f.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, i64]
        f.restype = ctypes.c_int
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    wc = w.float().contiguous()
    y = torch.empty_like(rows)
    width = rows.shape[1]
    if f(rows.data_ptr(), width, rows.shape[0], width, wc.data_ptr(), eps, y.data_ptr(), width):
        raise ValueError(f"rms_norm_cpu: bad call (x {tuple(x.shape)})")
    return y.view(x.shape)
