"""The `qwen2` architecture (Qwen2, Qwen2.5): the llama family with Q/K/V biases and NEOX RoPE
(llama.cpp's llm_build_qwen2). The biases are optional tensors of every member of the family
(kvtool/models/llama.py), so the variant only sets the rope."""

from __future__ import annotations

from kvtool.models.llama import Variant, family

ARCHITECTURES = {"qwen2": family(Variant(neox=True))}
