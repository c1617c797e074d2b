"""Architectures by GGUF `general.architecture` name."""

from kvtool.models.llama import LlamaModel

ARCHITECTURES = {"llama": LlamaModel}
