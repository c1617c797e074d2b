"""Architectures by GGUF `general.architecture` name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvtool.batch import UBatch
from kvtool.gguf_file import GGUFFile
from kvtool.memory.base import MemoryContext
from kvtool.memory.spec import MemorySpec
from kvtool.models.gemma3 import Gemma3Model
from kvtool.models.granite_hybrid import GraniteHybridModel
from kvtool.models.hparams import HParams
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
