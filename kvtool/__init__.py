"""kvtool: a GGUF inference engine with llama.cpp's memory model. This module is the public
API (what llama.h is to llama.cpp's tools): the commands import nothing else."""

from kvtool.batch import Batch, DecodeError
from kvtool.context import Context, ContextParams
from kvtool.decode import ContextFullError, context_shift, decode_batch, decode_tokens, resume_seq
from kvtool.errors import KvtoolError, ModelFetchError, ModelLoadError, StateError
from kvtool.kv_dims import KVDims, read_kv_dims
from kvtool.memory.base import MemoryStatus
from kvtool.memory.defrag import apply_defrag, plan_defrag
from kvtool.memory.kv_cells import KVCells
from kvtool.model import Model, load_model
from kvtool.registry import DEFAULT_MODEL, KNOWN_MODELS, fetch_model, is_present, model_path, resolve_model
from kvtool.sampling import Sampler, SamplerParams
from kvtool.state import ConversationStore, SeqInfo, StateInfo, inspect_state
from kvtool.threads import set_n_threads

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "Batch",
    "Context",
    "ContextFullError",
    "ContextParams",
    "ConversationStore",
    "DecodeError",
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
    "resolve_model",
    "resume_seq",
    "set_n_threads",
]
