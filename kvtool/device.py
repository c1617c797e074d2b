"""Where the engine computes: the CPU or one CUDA GPU (llama.cpp's device / -ngl).

A model is put on its device once, at load; a context computes on its model's device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvtool.errors import KvtoolError

DEVICES: tuple[str, ...] = ("cpu", "cuda")


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()  # asked once per process, when a device is first resolved


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The torch device for a name ("cpu", "cuda", "cuda:1"; None is the CPU). Raises
    KvtoolError for a kind kvtool does not compute on, or CUDA where torch finds no GPU."""
    try:
        d = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError):
        raise KvtoolError(f"unknown device '{device}' (one of: {', '.join(DEVICES)})") from None
    if d.type not in DEVICES:
        raise KvtoolError(f"unknown device '{device}' (one of: {', '.join(DEVICES)})")
    if d.type == "cuda":
        if not _cuda_available():
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise KvtoolError(f"device '{d}': torch {torch.__version__} ({built}) sees no CUDA GPU")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise KvtoolError(f"device '{d}': only {torch.cuda.device_count()} CUDA GPU(s)")
    return d


@dataclass(frozen=True)
class DeviceInfo:
    """A GPU as llama.cpp's --list-devices shows it."""

    name: str  # llama.cpp's name, which --device also reads: CUDA0, CUDA1, ...
    description: str  # the GPU's own name
    total: int  # bytes of memory
    free: int  # bytes free now


def available_devices() -> list[DeviceInfo]:
    """The GPUs kvtool can compute on; the CPU, always there, is not listed (as in llama.cpp)."""
    if not _cuda_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(DeviceInfo(f"CUDA{i}", torch.cuda.get_device_name(i), total, free))
    return out
