"""Gemma 3 through the compiled decoder call (kernels/decoder_cpu.c): a tiny quantized gemma3
(Q/K/V of one type in some layers, of several in others; sliding and global layers) decodes
small ubatches in one call, and its logits match the op-by-op forward to the rounding of the
8-bit activations (the norms are summed in another order), in every cache layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from kvtool import Batch, Context, ContextParams, Model
from kvtool.kernels import qmatmul
from tests.helpers import tiny_gemma3
from tests.helpers.tiny_gemma3 import TinyGemma3

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the kernel is not built")


class _QuantizingWriter(gguf.GGUFWriter):
    """Layer 0: Q5_0 Q/K with a Q8_0 V (three compiled weights); other layers Q4_1 throughout."""

    def add_tensor(self, name: str, tensor: np.ndarray, *args: Any, **kwargs: Any) -> None:
        if tensor.ndim == 2 and kwargs.get("raw_dtype") is None:
            if name == "token_embd.weight" or name == "blk.0.attn_v.weight":
                qtype = T.Q8_0
            else:
                qtype = T.Q5_0 if name.startswith("blk.0.") else T.Q4_1
            kwargs["raw_dtype"] = qtype
            tensor = quantize(tensor, qtype)
        super().add_tensor(name, tensor, *args, **kwargs)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("g")) / "tiny-gemma3-q.gguf"
    real = tiny_gemma3.gguf.GGUFWriter
    tiny_gemma3.gguf.GGUFWriter = _QuantizingWriter  # type: ignore[misc]
    try:
        cfg = TinyGemma3(n_embd=64, head_dim=32, n_ff=96, n_swa=6, swa_pattern=2)
        return tiny_gemma3.write_tiny_gemma3(path, cfg)
    finally:
        tiny_gemma3.gguf.GGUFWriter = real  # type: ignore[misc]


def _script(model: Model, kv_unified: bool, cache_type: str) -> list[torch.Tensor]:
    """Prompts of 3 sequences (one more rows than a compiled ubatch takes), then steps of a
    token of every sequence past the sliding window, then two tokens of one; every logit row."""
    p = ContextParams(n_ctx=256, n_seq_max=4, kv_unified=kv_unified, type_k=cache_type, type_v=cache_type)
    ctx = Context(model, p)
    out = []

    def decode(rows: list[tuple[int, int, int, bool]]) -> None:
        b = Batch()
        for tok, pos, seq, want in rows:
            b.add(tok, pos, (seq,), want)
        ctx.decode(b)
        out.append(ctx.logits().clone())

    lens = [20, 5, 3]
    for s, n in enumerate(lens):
        decode([(7 + (s * 5 + i) % 200, i, s, i >= n - 2) for i in range(n)])
    for step in range(8):
        decode([(30 + step * 3 + s, lens[s] + step, s, True) for s in range(3)])
    decode([(9, lens[1] + 8, 1, False), (10, lens[1] + 9, 1, True)])
    return out


def test_the_model_has_a_compiled_call_with_both_kinds_of_layer(model_path: Path) -> None:
    dec = Model(model_path).impl.decoder
    assert dec is not None
    assert dec.n_view == 2 and dec.view == [1, 0, 1, 0]  # sliding (view 1), global, ... (pattern 2)
    assert dec._arr[0].wk is not None and dec._arr[1].wk is None  # layer 0: Q, K, V apart


@pytest.mark.parametrize("kv_unified", [False, True])
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_compiled_gemma3_layers_match_the_op_by_op_forward(
    model_path: Path, kv_unified: bool, cache_type: str
) -> None:
    model = Model(model_path)
    dec = model.impl.decoder
    assert dec is not None
    ran: list[tuple[int, int]] = []
    run = dec.run

    def counted(x: torch.Tensor, il0: int, caches: list[Any], *args: Any) -> bool:
        done = run(x, il0, caches, *args)
        ran.append((x.shape[0], len(caches) if done else 0))
        return done

    dec.run = counted  # type: ignore[method-assign]
    compiled = _script(model, kv_unified, cache_type)
    model.impl.decoder = None
    op_by_op = _script(model, kv_unified, cache_type)
    n = model.hparams.n_layer
    assert ran == [(20, 0), (5, n - 1), (3, n - 1)] + [(3, n)] * 8 + [(2, n - 1)]
    for a, b in zip(compiled, op_by_op, strict=True):
        # one 8-bit quantum of an activation moved by the norms' summation order, under 1 %
        torch.testing.assert_close(a, b, rtol=0, atol=0.01 * float(b.abs().max()))
        assert torch.equal(a.argmax(-1), b.argmax(-1))
