"""The byte layout of a state: a safetensors container with a checksum (docs/state-format.md).

    u64 LE  N                      length of the header, a multiple of 8
    N bytes header                 canonical JSON, padded with spaces
    data                           the tensors, contiguous, in header order of offsets

The header is what the `safetensors` library reads: one entry per tensor and a
`__metadata__` map of strings holding the state header ("kvtool.state", itself canonical
JSON) and its checksum ("kvtool.checksum"). Canonical JSON is `json.dumps(sort_keys=True,
separators=(",", ":"), ensure_ascii=True, allow_nan=False)`. The checksum is the SHA-256 of
the unpadded header written with an empty checksum, followed by the data. Any header that
is not exactly what this writer produces is refused, so every byte of a file is covered.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtool.errors import StateError

STATE_KEY = "kvtool.state"
CHECKSUM_KEY = "kvtool.checksum"
MAX_HEADER = 64 << 20  # a header this large is not a state header

# safetensors dtype -> (bytes per element, torch dtype)
DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "F32": (4, torch.float32),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I64": (8, torch.int64),
    "I32": (4, torch.int32),
    "U64": (8, torch.uint64),
    "U8": (1, torch.uint8),
}
_NUMPY = {"I64": np.int64, "I32": np.int32, "U64": np.uint64, "U8": np.uint8, "F32": np.float32}
_FROM_TORCH = {t: name for name, (_, t) in DTYPES.items()}
_FROM_NUMPY = {np.dtype(t): name for name, t in _NUMPY.items()}

Array = np.ndarray | torch.Tensor


def canonical(obj: object) -> str:
    """The one JSON spelling of `obj` a state uses."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def shown(value: object, limit: int = 40) -> str:
    """A value from a state file as an error message may quote it: one line, ASCII, short (a
    file may hold any text in any field)."""
    text = ascii(value)[1:-1] if isinstance(value, str) else ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class RawTensor:
    """One tensor of a parsed container: its bytes are a view of the container's data."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).reshape(self.shape).copy()

    def torch(self) -> torch.Tensor:
        dt = DTYPES[self.dtype][1]
        if len(self.data) == 0:
            return torch.empty(self.shape, dtype=dt)
        return torch.frombuffer(bytearray(self.data), dtype=dt).reshape(self.shape)


def _encode(t: Array) -> tuple[str, list[int], bytes]:
    if isinstance(t, torch.Tensor):
        if t.dtype not in _FROM_TORCH:
            raise StateError(f"cannot store a {t.dtype} tensor in a state")
        c = t.detach().to("cpu").contiguous()
        raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
        return _FROM_TORCH[t.dtype], list(c.shape), raw
    a = np.ascontiguousarray(t)
    if a.dtype not in _FROM_NUMPY:
        raise StateError(f"cannot store a {a.dtype} array in a state")
    return _FROM_NUMPY[a.dtype], list(a.shape), a.astype(a.dtype.newbyteorder("<")).tobytes()


def _order(names_dtypes: Mapping[str, str]) -> list[str]:
    """Data order: wider elements first, then by name (every tensor starts aligned)."""
    return sorted(names_dtypes, key=lambda n: (-DTYPES[names_dtypes[n]][0], n))


def _header_bytes(index: dict[str, Any], state_json: str, checksum: str, pad: bool) -> bytes:
    head = dict(index)
    head["__metadata__"] = {STATE_KEY: state_json, CHECKSUM_KEY: checksum}
    raw = canonical(head).encode("ascii")
    return raw + b" " * (-len(raw) % 8) if pad else raw


def _checksum(index: dict[str, Any], state_json: str, data: bytes | memoryview) -> str:
    h = hashlib.sha256(_header_bytes(index, state_json, "", pad=False))
    h.update(data)
    return h.hexdigest()


def write_container(state: Mapping[str, Any], tensors: Mapping[str, Array]) -> bytes:
    """The container bytes for a state header and its tensors."""
    enc = {name: _encode(t) for name, t in tensors.items()}
    index: dict[str, Any] = {}
    chunks: list[bytes] = []
    off = 0
    for name in _order({n: e[0] for n, e in enc.items()}):
        dtype, shape, raw = enc[name]
        index[name] = {"data_offsets": [off, off + len(raw)], "dtype": dtype, "shape": shape}
        chunks.append(raw)
        off += len(raw)
    data = b"".join(chunks)
    try:
        state_json = canonical(state)
    except (TypeError, ValueError) as e:
        raise StateError(f"cannot save state: the header is not plain JSON ({e})") from None
    header = _header_bytes(index, state_json, _checksum(index, state_json, data), pad=True)
    return struct.pack("<Q", len(header)) + header + data


def _check_index(index: dict[str, Any]) -> int:
    """Validates the tensor entries (dtype, shape, contiguous offsets); returns the data size.
    Sizes are exact Python integers: a shape whose product overflows 64 bits is too large, not
    small."""
    end = 0
    try:
        names = _order({n: e["dtype"] for n, e in index.items()})
        for name in names:
            e = index[name]
            if set(e) != {"data_offsets", "dtype", "shape"} or not isinstance(e["shape"], list):
                raise ValueError(name)
            if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in e["shape"]):
                raise ValueError(name)
            if e["data_offsets"] != [end, end + math.prod(e["shape"]) * DTYPES[e["dtype"]][0]]:
                raise ValueError(name)
            end = e["data_offsets"][1]
    except (KeyError, TypeError, ValueError) as e:
        raise StateError(
            f"corrupted state: bad tensor entry {shown(e.args[0] if e.args else None)}"
        ) from None
    return end


_OTHER_FILES = (
    (b"GGUF", "a GGUF model file"),
    (b"SQLite format 3\0", "an SQLite database (a conversation store?)"),
)


def read_container(data: bytes | memoryview) -> tuple[dict[str, Any], dict[str, RawTensor]]:
    """Parses and verifies a container: (state header, tensors). Raises StateError."""
    buf = memoryview(data)
    if len(buf) < 8:
        raise StateError(f"truncated state: {len(buf)} bytes")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > MAX_HEADER or n % 8:
        for magic, what in _OTHER_FILES:  # files a user may give by mistake, said by name
            if bytes(buf[: len(magic)]) == magic:
                raise StateError(f"not a kvtool state: {what}")
        raise StateError("not a kvtool state (bad header length)")
    if 8 + n > len(buf):
        raise StateError(f"truncated state: the header needs {8 + n} bytes, the data has {len(buf)}")
    raw = bytes(buf[8 : 8 + n])
    try:
        head = json.loads(raw.decode("ascii"))
        meta = head.pop("__metadata__")
        state_json, checksum = meta[STATE_KEY], meta[CHECKSUM_KEY]
        state = json.loads(state_json)
        assert isinstance(state, dict) and isinstance(checksum, str)
    except (
        UnicodeDecodeError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        AssertionError,
        RecursionError,
    ):
        # RecursionError: JSON nested deeper than the parser's stack (no state nests so deep)
        raise StateError("not a kvtool state (unreadable header)") from None
    version_check(state)
    size = _check_index(head)
    body = buf[8 + n :]
    if len(body) < size:
        raise StateError(f"truncated state: {len(body)} of {size} data bytes")
    if len(body) > size:
        raise StateError(f"corrupted state: {len(body) - size} bytes after the data")
    try:  # json.loads takes NaN and Infinity, which the canonical form refuses
        altered = _header_bytes(head, state_json, checksum, pad=True) != raw or canonical(state) != state_json
    except (ValueError, RecursionError):
        altered = True
    if altered:
        raise StateError("corrupted state: the header was altered")
    if _checksum(head, state_json, body) != checksum:
        raise StateError("corrupted state: checksum mismatch")
    tensors = {
        name: RawTensor(e["dtype"], tuple(e["shape"]), body[e["data_offsets"][0] : e["data_offsets"][1]])
        for name, e in head.items()
    }
    return state, tensors


FORMAT = "kvtool.state"
VERSION = 3  # 2: separate K/V types; 3: quantized K/V types, app.* blobs, whole-GGUF model.content
READS = (2, 3)  # a version-2 state is a version-3 one of float caches, no blobs and a sampled model.content


def version_check(state: dict[str, Any]) -> None:
    """Refuses headers of another format or version (checked before the checksum, so a newer
    file gets the right message)."""
    if state.get("format") != FORMAT:
        raise StateError("not a kvtool state (no format tag)")
    if not isinstance(state.get("version"), int) or isinstance(state["version"], bool):
        raise StateError("corrupted state: no format version")
    if state["version"] not in READS:
        raise StateError(
            f"state format version {state.get('version')} is not supported "
            f"(this kvtool reads {' and '.join(map(str, READS))})"
        )
