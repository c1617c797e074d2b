"""Architectures by GGUF `general.architecture` name.

Each architecture lives in one module of this package, which names and shapes its tensors where
it loads them (kvtool/models/tensors.py) and registers itself in its module-level
`ARCHITECTURES` dict: adding a module adds the architecture. The modules are found here, once.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from kvtool.batch import UBatch
from kvtool.memory.base import MemoryContext
from kvtool.memory.spec import MemorySpec
from kvtool.models.inputs import ForwardInputs
from kvtool.models.tensors import ModelTensors


class Architecture(Protocol):
    """What the Model asks of an architecture's weights."""

    def memory_spec(self) -> MemorySpec: ...

    def forward(self, ub: UBatch, mctx: MemoryContext) -> torch.Tensor:
        """Logits [n_outputs, n_vocab] of the ubatch's output rows in row order, in a tensor
        the architecture does not reuse (the context may keep it as the decode's logits)."""
        ...


@runtime_checkable
class SplitForward(Architecture, Protocol):
    """An architecture whose forward is `compute(inputs(ub), ub, mctx)`: inputs copied to the
    device, then device work only (kvtool/models/inputs.py; what a CUDA graph replays)."""

    def inputs(self, ub: UBatch) -> ForwardInputs: ...

    def compute(self, inp: ForwardInputs, ub: UBatch, mctx: MemoryContext) -> torch.Tensor: ...


Build = Callable[[ModelTensors], Architecture]


def _registered() -> dict[str, Build]:
    """Every module's `ARCHITECTURES`; a name two modules claim is a programming error."""
    found: dict[str, Build] = {}
    for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{m.name}")
        archs: dict[str, Build] = getattr(module, "ARCHITECTURES", {})
        for name, build in archs.items():
            if name in found:
                raise RuntimeError(f"architecture {name!r} is registered twice (kvtool.models.{m.name})")
            found[name] = build
    return found


ARCHITECTURES: dict[str, Build] = _registered()
