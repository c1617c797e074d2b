"""Rewrites a GGUF with some keys changed, added or removed (read with gguf.GGUFReader, written
with gguf.GGUFWriter): the mismatched hyper-parameters of the tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

DROP = object()  # as an override value: remove the key


def _typed(value: tuple[Any, ...]) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    v, vtype, *sub = value
    if vtype != GGUFValueType.ARRAY:
        return v, vtype, None
    return v, vtype, sub[0] if sub else GGUFValueType.INT32


def rewrite(
    src: Path,
    dst: Path,
    overrides: dict[str, Any],
    drop_tensors: tuple[str, ...] = (),
    tensors: dict[str, np.ndarray] | None = None,
    tensor_data: dict[str, Any] | None = None,
) -> Path:
    """Copy of `src` at `dst` with `overrides` {key: value}, {key: (value, GGUFValueType)} or
    {key: (value, ARRAY, element type)}: a bare value keeps the key's type (a new key's type
    follows the Python value); `DROP` removes the key; an array's elements are INT32 unless
    given. Tensors named in `drop_tensors` are left out; `tensors` {name: float32 array}
    replaces or adds tensors; `tensor_data` {name: array} replaces a tensor's data (same type
    and shape)."""
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch)
    todo = dict(overrides)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype, sub = field.types[0], field.types[1] if len(field.types) > 1 else None
        value = field.contents()
        if key in todo:
            value = todo.pop(key)
            if value is DROP:
                continue
            if isinstance(value, tuple):
                value, vtype, sub = _typed(value)
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, value in todo.items():
        if value is DROP:
            continue
        if isinstance(value, tuple):
            value, vtype, sub = _typed(value)
        else:
            vtype = GGUFValueType.get_type(value)
            sub = GGUFValueType.INT32 if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    more = dict(tensors or {})
    for t in r.tensors:
        if t.name in more:
            w.add_tensor(t.name, more.pop(t.name))
        elif t.name not in drop_tensors:
            data = (tensor_data or {}).get(t.name, t.data)
            # quantized data comes as rows of bytes, and the writer takes their shape as it is
            shape = list(data.shape) if data.dtype == np.uint8 else list(reversed(t.shape.tolist()))
            w.add_tensor(t.name, data, raw_shape=shape, raw_dtype=t.tensor_type)
    for name, data in more.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
