"""The `olmo2` architecture (OLMo 2, OLMo 3): the llama family without norms before attention and
the feed-forward; instead each block's output is RMS-normed (`post_attention_norm`,
`post_ffw_norm`) before its residual add, Q and K are RMS-normed over the whole projection
(`attn_q_norm` [n_head * head_dim], `attn_k_norm` [n_head_kv * head_dim]), NEOX RoPE, and the
output is never tied. Where the GGUF sets `attention.sliding_window` (OLMo 3), layers slide by
pattern 4 (three sliding, then one global) and rotate with `rope.freq_base_swa` (else
`rope.freq_base`) without frequency scaling (llama.cpp's llm_build_olmo2)."""

from __future__ import annotations

from kvtool.models.llama import Variant, family

OLMO2 = Variant(neox=True, qk_norm="all", pre_norm=False, post_norm=True, output_required=True, swa_pattern=4)

ARCHITECTURES = {"olmo2": family(OLMO2)}
