"""The `granite` architecture (IBM Granite 3.x dense): the llama family (NORM RoPE, optional
biases) with Granite's scalars: embeddings times `embedding_scale`, each block's output times
`residual_scale` before its residual add, attention scaled by `attention.scale` instead of
1/sqrt(head_dim), logits divided by `logit_scale` (llama.cpp's llm_build_granite)."""

from __future__ import annotations

from kvtool.models.llama import Variant, family

ARCHITECTURES = {"granite": family(Variant(scales=True))}
