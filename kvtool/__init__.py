"""kvtool: a GGUF inference engine with llama.cpp's memory model. This module is the public
API (what llama.h is to llama.cpp's tools): the commands import nothing else."""

from kvtool.batch import Batch, DecodeError, UBatch
from kvtool.chat import ChatSession
from kvtool.context import Context, ContextParams
from kvtool.errors import (
    KvtoolError,
    ModelFetchError,
    ModelLoadError,
    StateError,
    TemplateError,
    TokenizerError,
)
from kvtool.generate import ContextFullError, Generation, TextStream, Timings, decode_tokens, generate
from kvtool.memory.base import MemoryStatus
from kvtool.model import Model, load_model
from kvtool.registry import DEFAULT_MODEL, KNOWN_MODELS, fetch_model, is_present, model_path, resolve_model
from kvtool.sampling import Sampler, SamplerParams

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "Batch",
    "ChatSession",
    "Context",
    "ContextFullError",
    "ContextParams",
    "DecodeError",
    "Generation",
    "KvtoolError",
    "MemoryStatus",
    "Model",
    "ModelFetchError",
    "ModelLoadError",
    "Sampler",
    "SamplerParams",
    "StateError",
    "TemplateError",
    "TextStream",
    "Timings",
    "TokenizerError",
    "UBatch",
    "decode_tokens",
    "fetch_model",
    "generate",
    "is_present",
    "load_model",
    "model_path",
    "resolve_model",
]
