"""Tiny models with quantized matrices: while `quantizing` is open, the fixtures' GGUF writer
stores every float 2-D tensor in the GGML type `qtype_of(name)` picks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import gguf
import numpy as np
from gguf.quants import quantize


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
