"""Errors that reach the user as one line (the CLI prints them and exits 2)."""

from __future__ import annotations


class KvtoolError(Exception):
    """Base of every error that is the user's input, not a bug: printed as one line."""


class ModelLoadError(KvtoolError):
    """The model file is missing, not GGUF, truncated, or of an unsupported kind."""


class TokenizerError(KvtoolError):
    """The GGUF's tokenizer metadata is missing or of an unsupported kind."""


class TemplateError(KvtoolError):
    """A chat template failed to render."""


class StateError(KvtoolError):
    """A state file or blob is unreadable or does not fit this model/context."""
