"""Tiny models with quantized matrices: while `quantizing` is open, the fixtures' GGUF writer
stores every float 2-D tensor in the GGML type `qtype_of(name)` picks; `quantized_copy` rewrites
a float GGUF (the tiny models in tests/data) with the tensors llama-quantize would quantize."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kvtool import Batch, Context, ContextParams, Model
from tests.helpers import lowbit


@contextlib.contextmanager
def quantizing(qtype_of: Callable[[str], gguf.GGMLQuantizationType]) -> Iterator[None]:
    real = gguf.GGUFWriter

    class Writer(real):  # type: ignore[valid-type,misc]
        def add_tensor(self, name: str, tensor: np.ndarray, *args: Any, **kwargs: Any) -> None:
            if tensor.ndim == 2 and kwargs.get("raw_dtype") is None:
                qtype = qtype_of(name)
                kwargs["raw_dtype"] = qtype
                tensor = quantize(tensor, qtype)
            super().add_tensor(name, tensor, *args, **kwargs)

    gguf.GGUFWriter = Writer  # type: ignore[misc]
    try:
        yield
    finally:
        gguf.GGUFWriter = real  # type: ignore[misc]


# the tensors llama-quantize leaves in float (llama-quant.cpp's tensor_allows_quantization): norms,
# the convolutions and RWKV's low-rank and per-channel tensors, which the scans read directly
_KEPT_FLOAT = ("_norm.weight", "ssm_conv1d", "shortconv.conv", "time_mix_first", "time_mix_lerp_fused")
_KEPT_FLOAT += tuple(f"time_mix_{x}.weight" for x in ("w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2"))
_KEPT_FLOAT += ("time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1", "time_mix_decay_w2")


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize would quantize tensor `name` of numpy `shape`: a 2-D weight that
    is not one of those it keeps in float."""
    return len(shape) == 2 and name.endswith("weight") and not any(k in name for k in _KEPT_FLOAT)


def quantized_copy(src: Path, dst: Path, qtype_of: Callable[[str, int], GGMLQuantizationType | None]) -> Path:
    """A copy of the float GGUF `src` whose quantizable tensors are stored in `qtype_of(name,
    row length)` (None: kept as they are): gguf's quantizer for the types it has, random
    blocks of the same spread (tests/helpers/lowbit.py) for the others."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(0)
    for t in reader.tensors:
        data = np.asarray(t.data)
        qtype = qtype_of(t.name, data.shape[-1]) if quantizable(t.name, data.shape) else None
        add_tensor(writer, t.name, data, qtype, rng, t.tensor_type)
    finish(writer)
    return dst


def add_tensor(
    w: gguf.GGUFWriter,
    name: str,
    data: np.ndarray,
    qtype: GGMLQuantizationType | None,
    rng: np.random.Generator,
    raw: GGMLQuantizationType | None = None,
) -> None:
    """Adds `data` (float, or already of type `raw`) as `qtype`, or as it is where that is None."""
    if qtype is None:
        w.add_tensor(name, data, raw_dtype=raw)
    elif qtype in lowbit.TYPES:
        w.add_tensor(name, lowbit.random_blocks(qtype, *data.shape, rng), raw_dtype=qtype)
    else:
        w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)


def finish(w: gguf.GGUFWriter) -> None:
    """Writes the header, the metadata and the tensors added, and closes the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def logits(model: Model, tokens: list[int], step: int, cache: str = "f16") -> torch.Tensor:
    """Every position's logits, decoding `step` tokens per llama_decode, K and V cached as `cache`."""
    ctx = Context(model, ContextParams(n_ctx=256, type_k=cache, type_v=cache))
    rows = []
    for i in range(0, len(tokens), step):
        part = tokens[i : i + step]
        ctx.decode(Batch(part, list(range(i, i + len(part))), [[0]] * len(part), [True] * len(part)))
        rows.append(ctx.logits().clone())
    return torch.cat(rows)
