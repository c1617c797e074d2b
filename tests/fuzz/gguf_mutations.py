"""Mutations of a valid GGUF file for fuzzing kvtool's loader.

The file's layout (where each header field, key/value, tensor info and tensor starts) is read
with `gguf.GGUFReader`, a parser independent of kvtool's own, so the mutations land on real
section boundaries and real fields: truncation at every boundary, bit flips, oversized counts
and lengths, wrong value and tensor types, changed hyper-parameters (numbers and per-layer
arrays), renamed keys (a key goes missing), tensor dims and offsets past the end of the file.
"""

from __future__ import annotations

import contextlib
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType


@dataclass(frozen=True)
class Part:
    """One encoded item of the header: a length, a count, a type id, a value."""

    offset: int
    fmt: str  # struct format of one element ("<Q", "<I", "<f", "<B" for bytes...)
    count: int  # elements
    role: str  # "count" (a length or count), "vtype", "ttype", "value", "name", "offset", "dims"
    key: str  # the key or tensor it belongs to


@dataclass(frozen=True)
class Layout:
    size: int
    boundaries: tuple[int, ...]  # every offset where a section, field or part starts
    parts: tuple[Part, ...]
    data_offset: int


_FMT = {
    np.dtype("uint8"): "<B",
    np.dtype("int8"): "<b",
    np.dtype("uint16"): "<H",
    np.dtype("int16"): "<h",
    np.dtype("uint32"): "<I",
    np.dtype("int32"): "<i",
    np.dtype("uint64"): "<Q",
    np.dtype("int64"): "<q",
    np.dtype("float32"): "<f",
    np.dtype("float64"): "<d",
    np.dtype("bool"): "<?",
}


def read_layout(path: Path) -> Layout:
    r = GGUFReader(str(path))
    parts: list[Part] = []
    bounds = {0, 4}
    for name, fld in r.fields.items():
        pos = fld.offset
        bounds.add(pos)
        header = name.startswith("GGUF.")
        for i, p in enumerate(fld.parts):
            fmt = _FMT[p.dtype]
            if header:
                role = "count" if name != "GGUF.version" else "value"
            elif i in (0,):
                role = "count"  # key length
            elif i == 1:
                role = "name"
            elif i == 2:
                role = "vtype"
            elif i in fld.data:
                role = "value" if fmt != "<B" or fld.types[-1] != GGUFValueType.STRING else "name"
            elif fld.types[0] == GGUFValueType.ARRAY and i == 3:
                role = "vtype"  # element type
            else:
                role = "count"  # string length or array count
            parts.append(Part(pos, fmt, int(p.size), role, name))
            pos += int(p.nbytes)
            bounds.add(pos)
    for t in r.tensors:
        pos = t.field.offset
        bounds.add(pos)
        roles = ["count", "name", "count", "dims", "ttype", "offset"]
        for p, role in zip(t.field.parts, roles, strict=True):
            parts.append(Part(pos, _FMT[p.dtype], int(p.size), role, t.name))
            pos += int(p.nbytes)
            bounds.add(pos)
        bounds.add(int(t.data_offset))
    size = path.stat().st_size
    bounds.update({r.data_offset, size - 1})
    return Layout(size, tuple(sorted(b for b in bounds if 0 <= b < size)), tuple(parts), r.data_offset)


def _interesting_ints(old: int, fmt: str, size: int) -> list[int]:
    bits = struct.calcsize(fmt) * 8
    signed = fmt[1].islower()
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    vals = [0, 1, 2, 3, old - 1, old + 1, old * 2, old // 2, hi, hi - 1, size, size + 1, 1 << (bits - 2)]
    if signed:
        vals += [-1, lo]
    return [v for v in vals if lo <= v <= hi and v != old]


_FLOATS = [0.0, -1.0, 1e-30, 1e30, float("nan"), float("inf"), -float("inf"), 0.5, 3.0]


def _put(buf: bytearray, pos: int, fmt: str, value: object) -> None:
    struct.pack_into(fmt, buf, pos, value)


@dataclass(frozen=True)
class Case:
    """A mutation, applied on demand (`data()`): enumerating thousands stays cheap."""

    name: str
    make: Callable[[], bytes]

    def data(self) -> bytes:
        return self.make()


def _patched(data: bytes, pos: int, fmt: str, value: object) -> Callable[[], bytes]:
    def make() -> bytes:
        buf = bytearray(data)
        _put(buf, pos, fmt, value)
        return bytes(buf)

    return make


def _value_cases(data: bytes, lay: Layout, p: Part, rng: random.Random) -> Iterator[Case]:
    """New values for one part: counts and numbers get edge values, type ids other types."""
    n = struct.calcsize(p.fmt)
    idx = rng.randrange(p.count) if p.count > 1 else 0
    pos = p.offset + idx * n
    (old,) = struct.unpack_from(p.fmt, data, pos)
    if p.role == "vtype":
        vals: list[object] = [v for v in [*range(14), 99, 0xFFFFFFFF] if v != old]
    elif p.role == "ttype":
        vals = [v for v in [0, 1, 2, 4, 8, 12, 30, 39, 40, 99, 0xFFFFFFFF] if v != old]
    elif p.fmt in ("<f", "<d"):
        vals = [v for v in _FLOATS if v != old]
    elif p.fmt == "<?":
        vals = [not old]
    elif p.role == "name":
        vals = [old ^ (1 << rng.randrange(7))]  # a renamed key or tensor (a missing one)
    else:
        vals = _interesting_ints(int(old), p.fmt, lay.size)
    for v in vals:
        yield Case(
            f"{p.role} {p.key}[{idx}]@{pos}={v!r}",
            _patched(data, pos, p.fmt if p.role != "name" else "<B", v),
        )


def all_cases(path: Path, rng: random.Random, n_random: int = 0) -> Iterator[Case]:
    """Every structured mutation of the file once (truncations at each boundary and one byte
    before it; every part given each of its edge values), then `n_random` bit-flip cases."""
    data = path.read_bytes()
    lay = read_layout(path)
    for b in lay.boundaries:
        for at in (b, b - 1) if b > 0 else (b,):
            yield Case(f"truncate@{at}", lambda at=at: data[:at])
    for p in lay.parts:
        yield from _value_cases(data, lay, p, rng)
    for _ in range(n_random):
        yield bit_flips(data, lay, rng)


def bit_flips(data: bytes, lay: Layout, rng: random.Random) -> Case:
    """One to eight bit flips, nine in ten in the header (flips in tensor data only change
    weights)."""
    flips = []
    for _ in range(rng.randint(1, 8)):
        end = lay.data_offset if rng.random() < 0.9 else lay.size
        flips.append((rng.randrange(end), rng.randrange(8)))

    def make() -> bytes:
        buf = bytearray(data)
        for pos, bit in flips:
            buf[pos] ^= 1 << bit
        return bytes(buf)

    return Case("flip " + ",".join(f"{p}.{b}" for p, b in flips), make)


def load_and_decode(path: Path) -> str:
    """Loads the file and, when that works, decodes one token with the model's own context
    length: "ok", or "error: <message>" for a KvtoolError. Any other exception propagates (the
    defect the fuzzing looks for)."""
    import warnings

    import kvtool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = kvtool.Model(path)
            ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=0))
            token = model.vocab.bos if model.vocab.bos is not None else 0
            ctx.decode(kvtool.Batch.from_tokens([token], seq_id=0, pos0=0, logits="last"))
            ctx.logits()
        except kvtool.KvtoolError as e:
            return f"error: {e}"
    return "ok"


@contextlib.contextmanager
def capped_address_space(headroom: int = 3 << 30) -> Iterator[None]:
    """While inside, allocations that would take the process's address space more than
    `headroom` bytes past its current size fail (MemoryError, or torch's RuntimeError): a
    fuzz case that allocates what the file does not justify shows up as a failure instead of
    swapping the machine. A no-op where the limit cannot be set."""
    try:
        import resource

        size = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (size + headroom, hard))
    except (ImportError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
