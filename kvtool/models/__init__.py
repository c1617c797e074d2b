"""Architectures by GGUF `general.architecture` name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from kvtool.batch import UBatch
from kvtool.gguf_file import GGUFFile
from kvtool.memory.base import MemoryContext
from kvtool.memory.spec import MemorySpec
from kvtool.models.gemma3 import Gemma3Model
from kvtool.models.granite_hybrid import GraniteHybridModel
from kvtool.models.hparams import HParams
from kvtool.models.inputs import ForwardInputs
from kvtool.models.lfm2 import Lfm2Model
from kvtool.models.llama import LlamaModel
from kvtool.models.mamba import MambaModel
from kvtool.models.mamba2 import Mamba2Model
from kvtool.models.rwkv6 import RWKV6Model
from kvtool.models.rwkv7 import RWKV7Model


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


ARCHITECTURES: dict[str, Callable[[GGUFFile, HParams, str], Architecture]] = {
    "llama": LlamaModel,
    "gemma3": Gemma3Model,
    "mamba": MambaModel,
    "mamba2": Mamba2Model,
    "rwkv6": RWKV6Model,
    "rwkv7": RWKV7Model,
    "granitehybrid": GraniteHybridModel,
    "lfm2": Lfm2Model,
}
