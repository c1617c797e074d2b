"""The `phi3` architecture (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): the llama family with one fused
`attn_qkv` weight (or Q, K and V apart), one fused `ffn_up` [2 * n_ff, n_embd] holding the gate
then the up projection, and NEOX RoPE, whose frequencies are divided by `rope_factors_short` where
the file has it (LongRoPE) and whose cos and sin are scaled by `rope.scaling.attn_factor`
(llama.cpp's llm_build_phi3).

As in llama.cpp, a sliding window the GGUF may set is not applied: llama.cpp disabled sliding
windows for Phi models (its PR 13676: the configs do not say which layers slide), and kvtool
matches its outputs. LongRoPE's `rope_factors_long` is for contexts of more than
`rope.scaling.original_context_length` tokens per sequence: llama.cpp switches to them there;
kvtool has the short ones only and refuses to decode in such a context (one line saying so).
"""

from __future__ import annotations

from kvtool.models.llama import Variant, family

ARCHITECTURES = {"phi3": family(Variant(neox=True, fused_up=True, rope_factors="short"))}
