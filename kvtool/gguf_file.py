"""Read-only access to a GGUF file: metadata and tensors, memory-mapped through `gguf`."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType

from kvtool.errors import ModelLoadError
from kvtool.kernels.dequant import dequantize

_MISSING = object()


class GGUFFile:
    """A GGUF file opened for reading. Tensors are dequantized on request, never eagerly."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(f"{self.path} is not a GGUF file (magic {magic!r})")
        try:
            self._reader = GGUFReader(self.path, "r")
        except Exception as e:  # the gguf package raises many kinds on truncated/corrupt input
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF ({type(e).__name__}: {e})") from e
        self._tensors = {t.name: t for t in self._reader.tensors}
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(f"{self.path}: truncated GGUF (tensor {t.name} runs past the end)")
        self.arch: str = str(self.get("general.architecture", ""))
        if not self.arch:
            raise ModelLoadError(f"{self.path}: GGUF has no general.architecture")

    # -- metadata -------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Metadata value by full key; arrays of numbers come back as numpy arrays."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path.name}: missing GGUF key {key}")
            return default
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1:
            if field.types[1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])
        return field.contents()

    def arch_get(self, suffix: str, default: Any = _MISSING) -> Any:
        """`{arch}.{suffix}`, e.g. arch_get("block_count")."""
        return self.get(f"{self.arch}.{suffix}", default)

    def keys(self) -> list[str]:
        return list(self._reader.fields)

    # -- tensors --------------------------------------------------------------------------------
    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """numpy/torch order: reversed ggml ne, so a linear weight is (n_out, n_in)."""
        return tuple(int(x) for x in reversed(self._tensors[name].shape.tolist()))

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized tensor in numpy order (reversed ggml ne)."""
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path.name}: missing tensor {name}")
        with warnings.catch_warnings():  # the mmap is read-only; weights are never written
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1))
        try:
            out = dequantize(raw, int(t.tensor_type), self.tensor_shape(name))
        except ValueError as e:
            raise ModelLoadError(f"{self.path.name}: tensor {name}: {e}") from e
        return out.to(dtype)

    def fingerprint(self) -> str:
        """Hash of architecture and every tensor's name, shape and type (not the data)."""
        h = hashlib.sha256(self.arch.encode())
        for t in self._reader.tensors:
            h.update(f"{t.name}:{t.shape.tolist()}:{t.tensor_type.name};".encode())
        return h.hexdigest()[:32]
