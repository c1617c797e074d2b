"""The llama family and gemma2 in dimensions and options that the oracle's tiny models do not have
(tests/helpers/tiny_archs.py VARIANTS: fused Q/K/V with biases, rope frequency factors, MQA and
GQA groups of 2 to 4, a head size apart from n_embd / n_head, LongRoPE factors with an attention
factor, a sliding window phi3 does not apply, a window pattern of 3 with its own rope base and
soft-caps, granite's scales with biases, OLMo 3's sliding layers), against llama.cpp's logits for
the same files (tests/data/variants, made by tests/helpers/make_variant_refs.py): a prompt of 20
tokens with every row an output, then 6 tokens one at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvtool
from tests.helpers.make_variant_refs import model_hash
from tests.helpers.tiny_archs import VARIANTS, write_tiny_arch
from tests.kvtool.test_oracle_tiny import rel_err

DATA = Path(__file__).parent.parent.parent / "data" / "variants"


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("variants")
    return {arch: write_tiny_arch(d / f"{arch}.gguf", cfg) for arch, cfg in VARIANTS.items()}


def replay(model: kvtool.Model, tokens: np.ndarray, n_prompt: int, unified: bool) -> np.ndarray:
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=256, n_seq_max=1, kv_unified=unified))
    ids = [int(t) for t in tokens]
    ctx.decode(kvtool.Batch.from_tokens(ids[:n_prompt], seq_id=0, pos0=0, logits="all"))
    rows = [ctx.logits().numpy().copy()]
    for pos in range(n_prompt, len(ids)):
        ctx.decode(kvtool.Batch.from_tokens([ids[pos]], seq_id=0, pos0=pos, logits="all"))
        rows.append(ctx.logits().numpy().copy())
    return np.concatenate(rows)


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("arch", sorted(VARIANTS))
def test_variant_gives_llama_cpps_logits(variants: dict[str, Path], arch: str, unified: bool) -> None:
    z = np.load(DATA / f"{arch}.npz")
    assert model_hash(variants[arch]) == str(z["model_sha256"]), (
        "the writer no longer makes llama.cpp's model"
    )
    got = replay(kvtool.Model(variants[arch]), z["tokens"], int(z["n_prompt"]), unified)
    assert rel_err(got, z["logits"]) <= 1e-3


def test_phi3_refuses_a_context_that_needs_longropes_long_factors(variants: dict[str, Path]) -> None:
    """llama.cpp rotates with rope_factors_long once a sequence's context exceeds
    rope.scaling.original_context_length (512 in this model); kvtool says it does not, in one line,
    rather than decode with the short factors."""
    model = kvtool.Model(variants["phi3"])
    ok = kvtool.Context(model, kvtool.ContextParams(n_ctx=512, n_seq_max=1))
    ok.decode(kvtool.Batch.from_tokens([5, 6, 7]))
    ctx = kvtool.Context(model, kvtool.ContextParams(n_ctx=2048, n_seq_max=4, kv_unified=False))  # 512 each
    ctx.decode(kvtool.Batch.from_tokens([5, 6, 7]))
    long = kvtool.Context(model, kvtool.ContextParams(n_ctx=1024, n_seq_max=1))
    with pytest.raises(kvtool.KvtoolError, match="original_context_length 512") as e:
        long.decode(kvtool.Batch.from_tokens([5, 6, 7]))
    assert "\n" not in str(e.value) and long.memory.seq_pos_max(0) == -1  # nothing kept
