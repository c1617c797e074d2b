"""Read-only access to a GGUF file: metadata and memory-mapped tensors.

The header is parsed here directly (struct + numpy views over one mmap) because
`gguf.GGUFReader` builds a numpy view per metadata element: 6-9 s for a 262k-token vocabulary
against well under a second here. Type ids and block sizes come from the `gguf` package, and
tests check this parser against GGUFReader.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvtool.errors import ModelLoadError
from kvtool.kernels import mmap_guard
from kvtool.kernels.dequant import dequantize

_MISSING = object()
_SCALARS: dict[int, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY: dict[int, np.dtype] = {t: np.dtype(f) for t, f in _SCALARS.items()}
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NAME = 64  # GGML_MAX_NAME: tensor names are shorter
_MAX_KEY = 256  # keys are short dotted names: a longer or unprintable one is corruption


def _q(text: str) -> str:
    """A name from the file, quoted and cut short for an error message (one line, bounded)."""
    r = repr(text)
    return r if len(r) <= 60 else r[:57] + "..."


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # ggml order
    qtype: int
    offset: int  # absolute, in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))


class _Cursor:
    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise ModelLoadError("truncated GGUF header")

    def scalar(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: ~100k), read in one tight loop: a method call
        per string and per length was most of the header's parse time."""
        buf, size, pos = self.buf, self.size, self.pos
        out: list[str] = []
        append, from_bytes = out.append, int.from_bytes
        for _ in range(count):
            if pos + 8 > size:
                raise ModelLoadError("truncated GGUF header")
            n = from_bytes(buf[pos : pos + 8], "little")
            pos += 8
            if pos + n > size:
                raise ModelLoadError("truncated GGUF header")
            append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype == GGUFValueType.STRING:
                return self.strings(count)
            if etype not in _NUMPY:
                raise ModelLoadError(f"unsupported GGUF array type {etype}")
            dt = _NUMPY[etype]
            self.need(count * dt.itemsize)
            arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
            self.pos += count * dt.itemsize
            return arr
        if vtype not in _SCALARS:
            raise ModelLoadError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


class GGUFFile:
    """A GGUF file opened for reading. Tensors are dequantized on request, never eagerly."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._content: str | None = None
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        size = self.path.stat().st_size
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
                if magic != b"GGUF":
                    raise ModelLoadError(f"{self.path} is not a GGUF file (magic {magic!r})")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:  # a file that cannot be read or mapped (/proc/self/mem: EIO)
            raise ModelLoadError(f"cannot read {self.path}: {e.strerror or e}") from None
        # a file truncated while mapped reads zeros past its end instead of killing the process
        # (SIGBUS); check_intact() then refuses what was computed from them
        self._guard = mmap_guard.guard(self._mm)
        if self._guard is not None:
            weakref.finalize(self, mmap_guard.unguard, self._guard)
        try:
            self._fields, self._tensors = self._parse(size)
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: {e}") from None
        except (ValueError, KeyError, struct.error, OverflowError, MemoryError) as e:
            raise ModelLoadError(f"{self.path}: corrupt GGUF ({type(e).__name__}: {e})") from None
        self.arch: str = str(self.get("general.architecture", ""))
        if not self.arch:
            raise ModelLoadError(f"{self.path}: GGUF has no general.architecture")

    def _parse(self, size: int) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        c = _Cursor(self._mm, size)
        c.pos = 4
        version = c.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        # the smallest key/value takes 13 bytes, the smallest tensor info 24: larger counts are
        # corrupt, and are refused before anything is read for them
        if n_kv * 13 + n_tensors * 24 > size - c.pos:
            raise ModelLoadError(f"{n_kv} keys and {n_tensors} tensors cannot fit in {size} bytes")
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            if len(key) > _MAX_KEY or not key.isprintable():
                raise ModelLoadError(f"corrupt key name {_q(key)}")
            if key in fields:
                raise ModelLoadError(f"duplicate key {key!r}")
            fields[key] = c.value(c.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            if len(name) >= _MAX_NAME or not name.isprintable():
                raise ModelLoadError(
                    f"corrupt tensor name {_q(name)} (at most {_MAX_NAME - 1} printable characters)"
                )
            n_dims = c.scalar("<I")
            if n_dims > _MAX_DIMS:
                raise ModelLoadError(f"tensor {name} has {n_dims} dimensions (at most {_MAX_DIMS})")
            ne = tuple(int(c.scalar("<Q")) for _ in range(n_dims))
            infos.append((name, ne, c.scalar("<I"), c.scalar("<Q")))
        align = fields.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
            raise ModelLoadError(f"general.alignment {align!r} is not a power of two")
        data = (c.pos + align - 1) // align * align
        tensors: dict[str, TensorInfo] = {}
        for name, ne, qtype, off in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise ModelLoadError(f"tensor {name} has unknown type id {qtype}") from None
            if name in tensors:
                raise ModelLoadError(f"duplicate tensor {name}")
            if ne and ne[0] % block:
                raise ModelLoadError(f"tensor {name}: rows of {ne[0]} are not whole blocks of {block}")
            if off % align:
                raise ModelLoadError(
                    f"tensor {name}: offset {off} is not a multiple of the alignment {align}"
                )
            n_bytes = math.prod(ne) // block * type_size  # exact: numpy's product would wrap around
            if data + off + n_bytes > size:
                raise ModelLoadError(f"truncated GGUF (tensor {name} runs past the end)")
            tensors[name] = TensorInfo(name, ne, qtype, data + off, n_bytes)
        return fields, tensors

    # -- metadata -------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """Metadata value by full key; arrays of numbers come back as numpy arrays, of strings as lists."""
        if key not in self._fields:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path.name}: missing GGUF key {key}")
            return default
        return self._fields[key]

    def arch_get(self, suffix: str, default: Any = _MISSING) -> Any:
        """`{arch}.{suffix}`, e.g. arch_get("block_count")."""
        return self.get(f"{self.arch}.{suffix}", default)

    def keys(self) -> list[str]:
        return list(self._fields)

    # -- tensors --------------------------------------------------------------------------------
    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> TensorInfo:
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.path.name}: missing tensor {name}")
        return t

    def tensor_type(self, name: str) -> str:
        return GGMLQuantizationType(self.tensor_info(name).qtype).name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """numpy/torch order: reversed ggml ne, so a linear weight is (n_out, n_in)."""
        return self.tensor_info(name).shape

    def tensor_bytes(self, name: str) -> torch.Tensor:
        """The raw bytes of a tensor: a uint8 view of the memory map (read-only, no copy)."""
        t = self.tensor_info(name)
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=t.n_bytes, offset=t.offset)
        with warnings.catch_warnings():  # the map is read-only; weights are never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized tensor in numpy order (reversed ggml ne)."""
        t = self.tensor_info(name)
        try:
            out = dequantize(self.tensor_bytes(name), t.qtype, t.shape)
        except ValueError as e:
            raise ModelLoadError(f"{self.path.name}: tensor {name}: {e}") from e
        return out.to(dtype)

    def check_intact(self) -> None:
        """Raises ModelLoadError if a read found part of the file gone (it was truncated while
        mapped): what was computed since is wrong."""
        if self._guard is not None and mmap_guard.faults(self._guard):
            raise ModelLoadError(
                f"{self.path}: the model file was cut short while in use (truncated or rewritten): "
                "load it again"
            )

    def content_hash(self) -> str:
        """SHA-256 of the whole file as it is mapped (metadata and every weight: what a saved
        state depends on), first 32 hex digits; computed on first use, then kept. The map is
        the model's own bytes: a file replaced on disk since the load does not change it."""
        if self._content is None:
            digest = hashlib.sha256(self._mm).hexdigest()[:32]
            self.check_intact()
            self._content = digest
        return self._content

    def fingerprint(self) -> str:
        """Hash of architecture and every tensor's name, shape and type (not the data)."""
        h = hashlib.sha256(self.arch.encode())
        for t in self._tensors.values():
            h.update(f"{t.name}:{list(t.ne)}:{GGMLQuantizationType(t.qtype).name};".encode())
        return h.hexdigest()[:32]
