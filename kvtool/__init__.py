"""kvtool: a GGUF inference engine with llama.cpp's memory model. This module is the public
API (what llama.h is to llama.cpp's tools): the commands import nothing else.

Names are resolved on first use (PEP 562), so that `kvtool --help` and the light parts of the
API (errors, the model registry) answer without importing torch."""

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
    "Batch": "kvtool.batch",
    "DecodeError": "kvtool.batch",
    "Context": "kvtool.context",
    "ContextParams": "kvtool.context",
    "ContextFullError": "kvtool.decode",
    "decode_batch": "kvtool.decode",
    "decode_tokens": "kvtool.decode",
    "resume_seq": "kvtool.decode",
    "context_shift": "kvtool.decode",
    "resolve_device": "kvtool.device",
    "available_devices": "kvtool.device",
    "DeviceInfo": "kvtool.device",
    "KVDims": "kvtool.kv_dims",
    "read_kv_dims": "kvtool.kv_dims",
    "apply_defrag": "kvtool.memory.defrag",
    "plan_defrag": "kvtool.memory.defrag",
    "KVCells": "kvtool.memory.kv_cells",
    "KvtoolError": "kvtool.errors",
    "ModelFetchError": "kvtool.errors",
    "ModelLoadError": "kvtool.errors",
    "StateError": "kvtool.errors",
    "FileKind": "kvtool.atomic_file",
    "check_writable": "kvtool.atomic_file",
    "write_file": "kvtool.atomic_file",
    "MemoryStatus": "kvtool.memory.base",
    "Model": "kvtool.model",
    "load_model": "kvtool.model",
    "DEFAULT_MODEL": "kvtool.registry",
    "KNOWN_MODELS": "kvtool.registry",
    "fetch_model": "kvtool.registry",
    "is_present": "kvtool.registry",
    "model_path": "kvtool.registry",
    "resolve_model": "kvtool.registry",
    "Sampler": "kvtool.sampling",
    "SamplerParams": "kvtool.sampling",
    "ConversationStore": "kvtool.state",
    "ConversationConflictError": "kvtool.state",
    "SeqInfo": "kvtool.state",
    "StateInfo": "kvtool.state",
    "inspect_state": "kvtool.state",
    "check_state_path": "kvtool.state",
    "set_n_threads": "kvtool.threads",
}

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "Batch",
    "Context",
    "ContextFullError",
    "ContextParams",
    "ConversationConflictError",
    "ConversationStore",
    "DecodeError",
    "DeviceInfo",
    "FileKind",
    "KVCells",
    "KVDims",
    "KvtoolError",
    "MemoryStatus",
    "Model",
    "ModelFetchError",
    "ModelLoadError",
    "Sampler",
    "SamplerParams",
    "SeqInfo",
    "StateError",
    "StateInfo",
    "apply_defrag",
    "available_devices",
    "check_state_path",
    "check_writable",
    "context_shift",
    "decode_batch",
    "decode_tokens",
    "fetch_model",
    "inspect_state",
    "is_present",
    "load_model",
    "model_path",
    "plan_defrag",
    "read_kv_dims",
    "resolve_device",
    "resolve_model",
    "resume_seq",
    "set_n_threads",
    "write_file",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # what type checkers and editors see
    from kvtool.atomic_file import FileKind, check_writable, write_file
    from kvtool.batch import Batch, DecodeError
    from kvtool.context import Context, ContextParams
    from kvtool.decode import ContextFullError, context_shift, decode_batch, decode_tokens, resume_seq
    from kvtool.device import DeviceInfo, available_devices, resolve_device
    from kvtool.errors import KvtoolError, ModelFetchError, ModelLoadError, StateError
    from kvtool.kv_dims import KVDims, read_kv_dims
    from kvtool.memory.base import MemoryStatus
    from kvtool.memory.defrag import apply_defrag, plan_defrag
    from kvtool.memory.kv_cells import KVCells
    from kvtool.model import Model, load_model
    from kvtool.registry import (
        DEFAULT_MODEL,
        KNOWN_MODELS,
        fetch_model,
        is_present,
        model_path,
        resolve_model,
    )
    from kvtool.sampling import Sampler, SamplerParams
    from kvtool.state import (
        ConversationConflictError,
        ConversationStore,
        SeqInfo,
        StateInfo,
        check_state_path,
        inspect_state,
    )
    from kvtool.threads import set_n_threads
