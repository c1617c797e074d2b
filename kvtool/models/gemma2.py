"""The `gemma2` architecture (Gemma 2): the Gemma family (kvtool/models/gemma3.py) without Q/K
norms, with the attention scores soft-capped (`attn_logit_softcapping`, 50 by default) and the
logits soft-capped (`final_logit_softcapping`, 30 by default), every other layer sliding (pattern
2, from layer 0) over a window of 4096 unless the GGUF says otherwise; sliding layers rotate with
`rope.freq_base` unless `rope.freq_base_swa` is set (llama.cpp's llm_build_gemma2)."""

from __future__ import annotations

from kvtool.models.gemma3 import Gemma3Model, Variant
from kvtool.models.tensors import ModelTensors

GEMMA2 = Variant(
    qk_norm=False, swa_pattern=2, n_swa=4096, swa_rope_base=None, attn_softcap=50.0, final_softcap=30.0
)


def gemma2(t: ModelTensors) -> Gemma3Model:
    return Gemma3Model(t, GEMMA2)


ARCHITECTURES = {"gemma2": gemma2}
