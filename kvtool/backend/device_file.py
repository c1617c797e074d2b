"""A GGUF file whose tensors are dequantized on a device: what a model loads onto a GPU."""

from __future__ import annotations

from typing import Any, cast

import torch

from kvtool.errors import ModelLoadError
from kvtool.gguf_file import GGUFFile
from kvtool.kernels.dequant import dequantize


class DeviceFile:
    """`GGUFFile` with `tensor()` on `device`: the raw (quantized) bytes are copied there once
    and dequantized there by kernels/dequant (bit-exact with the CPU), so a 4-bit model crosses
    the bus at its file size. Everything else is the file's."""

    def __init__(self, f: GGUFFile, device: torch.device) -> None:
        self._file = f
        self.device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized tensor in numpy order, on the device."""
        t = self._file.tensor_info(name)
        raw = self._file.tensor_bytes(name).to(self.device)
        try:
            out = dequantize(raw, t.qtype, t.shape)
        except ValueError as e:
            raise ModelLoadError(f"{self._file.path.name}: tensor {name}: {e}") from e
        return out.to(dtype)


def on_device(f: GGUFFile, device: torch.device) -> GGUFFile:
    """`f` as the models read it on `device`: itself on the CPU, else a `DeviceFile` (which
    the models take for the GGUFFile it forwards to)."""
    return f if device.type == "cpu" else cast(GGUFFile, DeviceFile(f, device))
