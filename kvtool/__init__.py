"""kvtool: a GGUF inference engine with llama.cpp's memory model. This module is the public
API (what llama.h is to llama.cpp's tools): models, contexts, batches, decoding, sampling,
state, devices, errors. What the tools share beyond it (the model registry, the conversation
store, file writing, cell simulation) is the common layer, kvtool.common.

Names are resolved on first use (PEP 562), so that `kvtool --help` and the light parts of the
API (errors, devices' names) answer without importing torch."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# torch's OpenMP workers sleep when a parallel region ends instead of spinning for some
# milliseconds: the compiled kernels' own pool (kernels/cpu_pool.c) runs between torch's ops, and
# spinning workers took its cores (a 512-token prompt of SmolLM2 on 2 threads: 1189 against 766
# ms). Read once, when torch loads its OpenMP runtime; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# the module each public name lives in
_WHERE = {
    "Model": "kvtool.model",
    "load_model": "kvtool.common.registry",  # the design card's API takes a known name too
    "Context": "kvtool.context",
    "ContextParams": "kvtool.context",
    "Batch": "kvtool.batch",
    "DecodeError": "kvtool.batch",
    "MemoryStatus": "kvtool.memory.base",
    "decode_batch": "kvtool.decode",
    "decode_tokens": "kvtool.decode",
    "resume_seq": "kvtool.decode",
    "context_shift": "kvtool.decode",
    "ContextFullError": "kvtool.decode",
    "Sampler": "kvtool.sampling",
    "SamplerParams": "kvtool.sampling",
    "StateInfo": "kvtool.state",
    "inspect_state": "kvtool.state",
    "check_state_path": "kvtool.state",
    "resolve_device": "kvtool.device",
    "available_devices": "kvtool.device",
    "set_n_threads": "kvtool.threads",
    "KvtoolError": "kvtool.errors",
    "ModelLoadError": "kvtool.errors",
    "StateError": "kvtool.errors",
}

__all__ = [
    "Batch",
    "Context",
    "ContextFullError",
    "ContextParams",
    "DecodeError",
    "KvtoolError",
    "MemoryStatus",
    "Model",
    "ModelLoadError",
    "Sampler",
    "SamplerParams",
    "StateError",
    "StateInfo",
    "available_devices",
    "check_state_path",
    "context_shift",
    "decode_batch",
    "decode_tokens",
    "inspect_state",
    "load_model",
    "resolve_device",
    "resume_seq",
    "set_n_threads",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # what type checkers and editors see
    from kvtool.batch import Batch, DecodeError
    from kvtool.common.registry import load_model
    from kvtool.context import Context, ContextParams
    from kvtool.decode import ContextFullError, context_shift, decode_batch, decode_tokens, resume_seq
    from kvtool.device import available_devices, resolve_device
    from kvtool.errors import KvtoolError, ModelLoadError, StateError
    from kvtool.memory.base import MemoryStatus
    from kvtool.model import Model
    from kvtool.sampling import Sampler, SamplerParams
    from kvtool.state import StateInfo, check_state_path, inspect_state
    from kvtool.threads import set_n_threads
