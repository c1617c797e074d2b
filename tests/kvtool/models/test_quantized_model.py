"""A whole quantized model (tiny llama, Q4_1 matrices, Q8_0 embeddings and output) on the
default weights: few-row ubatches run the compiled kernel with torch on one thread, many-row
ones the dense float32 path, which is exactly the f32 mode's; both against `weights="f32"`."""

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
from kvtool.kernels import cpu_lib, qmatmul
from kvtool.models.linear import QUANT_MAX_ROWS, QuantLinear
from kvtool.threads import compute_threads
from tests.helpers import tiny_gguf

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the kernel is not built")


class _QuantizingWriter(gguf.GGUFWriter):
    def add_tensor(self, name: str, tensor: np.ndarray, *args: Any, **kwargs: Any) -> None:
        if tensor.ndim == 2 and kwargs.get("raw_dtype") is None:
            qtype = T.Q8_0 if name in ("token_embd.weight", "output.weight") else T.Q4_1
            kwargs["raw_dtype"] = qtype
            tensor = quantize(tensor, qtype)
        super().add_tensor(name, tensor, *args, **kwargs)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("q")) / "tiny-q4_1.gguf"
    real = tiny_gguf.gguf.GGUFWriter
    tiny_gguf.gguf.GGUFWriter = _QuantizingWriter  # type: ignore[misc]
    try:
        return tiny_gguf.write_tiny_llama(path)
    finally:
        tiny_gguf.gguf.GGUFWriter = real  # type: ignore[misc]


def logits(model: Model, tokens: list[int], step: int) -> torch.Tensor:
    """Every position's logits, decoding `step` tokens per llama_decode."""
    ctx = Context(model, ContextParams(n_ctx=256))
    rows = []
    for i in range(0, len(tokens), step):
        part = tokens[i : i + step]
        ctx.decode(Batch(part, list(range(i, i + len(part))), [[0]] * len(part), [True] * len(part)))
        rows.append(ctx.logits().clone())
    return torch.cat(rows)


def test_quantized_model_against_the_f32_mode(model_path: Path) -> None:
    auto, exact = Model(model_path), Model(model_path, weights="f32")
    layer = auto.impl.layers[0]
    assert isinstance(layer.ffn_down, QuantLinear) and layer.ffn_down.native is not None
    tokens = ([1, 5, 9, 3, 7, 11, 4, 8, 2, 6] * 8)[: 2 * (QUANT_MAX_ROWS + 1)]
    want = logits(exact, tokens, len(tokens))
    threads = compute_threads()
    few = logits(auto, tokens, 1)  # one row per ubatch: the compiled kernel
    # between ubatches torch idles on one thread; the configured threads stay the pool's
    assert torch.get_num_threads() == 1 and compute_threads() == threads
    err = (few - want).abs().max() / want.abs().max()
    assert float(err) < 0.03, float(err)  # int8 activations, as llama.cpp's CPU backend
    assert (few.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    many = logits(auto, tokens, QUANT_MAX_ROWS + 1)  # two ubatches of many rows (prompts)
    gate_up = layer.ffn_gate_up.fused
    if gate_up is not None and gate_up.native is not None and gate_up.native.panels:  # the panel kernel
        err = (many - want).abs().max() / want.abs().max()
        assert float(err) < 0.03, float(err)
        assert (many.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    else:  # dense float32 GEMMs: f32 mode's numbers
        torch.testing.assert_close(many, want, rtol=1e-5, atol=1e-5)


def _decode_script(model: Model, kv_unified: bool, cache_type: str) -> list[torch.Tensor]:
    """Prompts of 3 sequences (one longer than a compiled ubatch takes), then steps decoding a
    token of every sequence in one batch, then two tokens of one; every batch's logits."""
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
    for step in range(4):
        decode([(30 + step * 3 + s, lens[s] + step, s, True) for s in range(3)])
    decode([(9, lens[1] + 4, 1, False), (10, lens[1] + 5, 1, True)])
    return out


@pytest.mark.parametrize("kv_unified", [False, True])
@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16"])
def test_compiled_decoder_layers_give_the_op_by_op_bits(
    model_path: Path, kv_unified: bool, cache_type: str
) -> None:
    """kernels/decoder_cpu.c chains the kernels the op-by-op forward calls, in its order: the
    logits are the same bits, for every cache type, split and unified, and ubatches with only
    some rows as outputs (the last layer then runs op by op)."""
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
    compiled = _decode_script(model, kv_unified, cache_type)
    model.impl.decoder = None
    op_by_op = _decode_script(model, kv_unified, cache_type)
    n_layer = model.hparams.n_layer
    # the 20-row prompt is more rows of a stream than the kernel takes; the others ran compiled,
    # all layers where every row is an output, all but the last where some are not
    assert ran == [(20, 0), (5, n_layer - 1), (3, n_layer - 1)] + [(3, n_layer)] * 4 + [(2, n_layer - 1)]
    for a, b in zip(compiled, op_by_op, strict=True):
        assert torch.equal(a, b)


def test_compiled_decoder_layers_across_contexts_of_other_shapes(model_path: Path) -> None:
    """One model, contexts made and dropped one after another (a new cache may reuse a freed
    one's address with other strides): each gets descriptions of its own cache."""
    model = Model(model_path)
    dec = model.impl.decoder
    compiled = []
    for kv_unified, cache_type in [(False, "f32"), (True, "f16"), (False, "bf16"), (False, "f32")]:
        compiled.append(_decode_script(model, kv_unified, cache_type))
    model.impl.decoder = None
    for (kv_unified, cache_type), got in zip(
        [(False, "f32"), (True, "f16"), (False, "bf16"), (False, "f32")], compiled, strict=True
    ):
        want = _decode_script(model, kv_unified, cache_type)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert dec is not None and dec._caches  # the compiled call ran


def test_compiled_decoder_layers_in_the_portable_build(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain C build (what a machine without AVX2 compiles) chains the same way: with every
    kernel from it, compiled layers and op by op give the same bits."""
    cc = cpu_lib._compiler()
    path = cpu_lib.build(cc, portable=True) if cc else None
    portable = cpu_lib.load(path) if path is not None else None
    if portable is None:
        pytest.skip("no portable build")
    model = Model(model_path)
    dec = model.impl.decoder
    monkeypatch.setattr(cpu_lib, "lib", lambda: portable)
    compiled = _decode_script(model, False, "f16")
    model.impl.decoder = None
    op_by_op = _decode_script(model, False, "f16")
    assert dec is not None and dec._caches  # the compiled call ran
    assert all(torch.equal(a, b) for a, b in zip(compiled, op_by_op, strict=True))
