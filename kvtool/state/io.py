"""What a memory writes its state to and reads it from (mlx-lm's state/meta_state idea).

A memory kind owns the layout (JSON) and tensors of its part of a state file; composites give
each part a sub-writer or sub-reader (`part(name)`), which prefixes tensor names with the part's
path ("memory.base.k.3") and nests the part's layout under the composite's `parts`. Nothing here
knows any memory kind: a new kind saves and loads without an edit in kvtool/state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kvtool.errors import StateError
from kvtool.state.container import DTYPES, Array, RawTensor, shown

_NAMES = {t: name for name, (_, t) in DTYPES.items()}


def type_name(dtype: torch.dtype) -> str:
    """The state file's name of a tensor type ("F32", "F16", "BF16", ...)."""
    return _NAMES[dtype]


class StateWriter:
    """Collects the layout and tensors of one memory part (sub-writers share the tensors)."""

    def __init__(
        self,
        prefix: str = "memory.",
        tensors: dict[str, Array] | None = None,
        counts: dict[int, int] | None = None,
    ) -> None:
        self.prefix = prefix
        self.layout: dict[str, Any] = {}
        self.tensors: dict[str, Array] = {} if tensors is None else tensors
        self.counts: dict[int, int] = {} if counts is None else counts  # seq -> cells saved

    def put(self, name: str, array: Array) -> None:
        self.tensors[self.prefix + name] = array

    def count(self, seq: int, n: int) -> None:
        """Records that `n` cells (or state slots) of `seq` were saved; the part holding the
        most cells of a sequence speaks for it."""
        self.counts[seq] = max(self.counts.get(seq, 0), n)

    def part(self, name: str) -> StateWriter:
        child = StateWriter(f"{self.prefix}{name}.", self.tensors, self.counts)
        self.layout.setdefault("parts", {})[name] = child.layout
        return child


class StateReader:
    """Hands one memory part its saved layout and tensors; `take` removes what it returns, so the
    caller can refuse a state with tensors nobody read."""

    def __init__(self, layout: Any, tensors: dict[str, RawTensor], prefix: str = "memory.") -> None:
        if not isinstance(layout, Mapping):
            raise StateError("corrupted state: bad memory layout")
        self.layout: Mapping[str, Any] = layout
        self.tensors = tensors
        self.prefix = prefix

    def expect_kind(self, kind: str) -> None:
        saved = self.layout.get("kind")
        if saved != kind:
            raise StateError(f"state holds a '{shown(saved)}' memory but this context has a '{kind}' memory")

    def part(self, name: str) -> StateReader:
        parts = self.layout.get("parts")
        if not isinstance(parts, Mapping) or name not in parts:
            raise StateError(f"corrupted state: the memory part '{name}' is missing")
        return StateReader(parts[name], self.tensors, f"{self.prefix}{name}.")

    def part_names(self) -> list[str]:
        parts = self.layout.get("parts")
        return sorted(parts) if isinstance(parts, Mapping) else []

    def take(self, name: str, dtype: str, shape: tuple[int, ...]) -> RawTensor:
        full = self.prefix + name
        t = self.tensors.pop(full, None)
        if t is None or t.dtype != dtype or t.shape != shape:
            raise StateError(f"corrupted state: tensor {full} is missing or has the wrong type or shape")
        return t

    def take_numpy(self, name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        return self.take(name, dtype, shape).numpy()

    def take_torch(self, name: str, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.take(name, dtype, shape).torch()
