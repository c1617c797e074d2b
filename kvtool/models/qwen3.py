"""The `qwen3` architecture (Qwen3 dense): the llama family with Q and K RMS-normed per head
before RoPE (`attn_q_norm`, `attn_k_norm` [head_dim]), NEOX RoPE, and a head size that
`attention.key_length` may set apart from n_embd / n_head (llama.cpp's llm_build_qwen3)."""

from __future__ import annotations

from kvtool.models.llama import Variant, family

ARCHITECTURES = {"qwen3": family(Variant(neox=True, qk_norm="head"))}
