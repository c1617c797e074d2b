"""kvtool: a GGUF inference engine with llama.cpp's memory model (public API, like llama.h)."""

from kvtool.errors import KvtoolError, ModelFetchError, ModelLoadError, StateError, TemplateError

__all__ = ["KvtoolError", "ModelFetchError", "ModelLoadError", "StateError", "TemplateError"]
