"""A whole quantized model (tiny llama, Q4_1 matrices, Q8_0 embeddings and output) on the
default weights: few-row ubatches run the compiled kernel with torch on one thread, many-row
ones the dense float32 path, which is exactly the f32 mode's; both against `weights="f32"`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvtool import Model
from kvtool.backend.linear import QUANT_MAX_ROWS, QuantLinear
from kvtool.kernels import cpu_lib, qmatmul
from kvtool.threads import compute_threads
from tests.helpers import tiny_gguf
from tests.helpers.decoder_script import count_runs, decode_script, expected_runs
from tests.helpers.quantized import logits, quantizing

pytestmark = pytest.mark.skipif(not qmatmul.available(), reason="no C compiler: the kernel is not built")


def _qtype(name: str) -> T:
    return T.Q8_0 if name in ("token_embd.weight", "output.weight") else T.Q4_1


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with quantizing(_qtype):
        return tiny_gguf.write_tiny_llama(Path(tmp_path_factory.mktemp("q")) / "tiny-q4_1.gguf")


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
    ran = count_runs(dec)
    compiled = decode_script(model, kv_unified, cache_type)
    model.impl.decoder = None
    op_by_op = decode_script(model, kv_unified, cache_type)
    assert ran == expected_runs(model.hparams.n_layer)
    for a, b in zip(compiled, op_by_op, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def model_hd64_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Heads of 64 values: every quantized cache type fits, with llama.cpp's Hadamard rotation."""
    cfg = tiny_gguf.TinyLlama(n_embd=128, n_head=2, n_head_kv=1, n_ff=96, seed=3)
    with quantizing(_qtype):
        return tiny_gguf.write_tiny_llama(Path(tmp_path_factory.mktemp("q")) / "tiny-hd64.gguf", cfg)


@pytest.mark.parametrize("kv_unified", [False, True])
@pytest.mark.parametrize(
    ("type_k", "type_v"),
    [("q8_0", "q8_0"), ("q4_0", "q5_1"), ("iq4_nl", "f16"), ("f32", "q4_1"), ("q5_0", "bf16")],
)
def test_compiled_decoder_layers_over_quantized_caches_give_the_op_by_op_bits(
    model_hd64_path: Path, kv_unified: bool, type_k: str, type_v: str
) -> None:
    """Blocks stored, read and rotated (K and V each where quantized) in the compiled call as op
    by op: the same bits."""
    model = Model(model_hd64_path)
    dec = model.impl.decoder
    assert dec is not None
    ran = count_runs(dec)
    compiled = decode_script(model, kv_unified, type_k, type_v=type_v)
    model.impl.decoder = None
    op_by_op = decode_script(model, kv_unified, type_k, type_v=type_v)
    assert ran == expected_runs(model.hparams.n_layer)
    for a, b in zip(compiled, op_by_op, strict=True):
        assert torch.equal(a, b)


def test_compiled_decoder_layers_across_contexts_of_other_shapes(model_path: Path) -> None:
    """One model, contexts made and dropped one after another (a new cache may reuse a freed
    one's address with other strides): each gets descriptions of its own cache."""
    model = Model(model_path)
    dec = model.impl.decoder
    compiled = []
    for kv_unified, cache_type in [(False, "f32"), (True, "f16"), (False, "bf16"), (False, "f32")]:
        compiled.append(decode_script(model, kv_unified, cache_type))
    model.impl.decoder = None
    for (kv_unified, cache_type), got in zip(
        [(False, "f32"), (True, "f16"), (False, "bf16"), (False, "f32")], compiled, strict=True
    ):
        want = decode_script(model, kv_unified, cache_type)
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
    compiled = decode_script(model, False, "f16")
    model.impl.decoder = None
    op_by_op = decode_script(model, False, "f16")
    assert dec is not None and dec._caches  # the compiled call ran
    assert all(torch.equal(a, b) for a, b in zip(compiled, op_by_op, strict=True))


def test_without_a_compiler_the_model_runs_on_torchs_int4_matmul(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No C compiler (or a build that failed): no compiled kernel at all; the Q4_1 matrices are
    packed for torch's int4pack matmul and the Q8_0 ones stay float32, prompt and decode run
    end to end, and the logits stay those of the float32 weights (int4pack dequantizes Q4_1
    exactly; its bfloat16 activations are the difference)."""
    exact = Model(model_path, weights="f32")
    tokens = [1, 5, 9, 3, 7, 11, 4, 8, 2, 6, 12, 10]
    want = logits(exact, tokens, 1)
    monkeypatch.setattr(cpu_lib, "lib", lambda: None)
    model = Model(model_path)
    layer = model.impl.layers[0]
    assert model.impl.decoder is None
    assert isinstance(layer.ffn_down, QuantLinear) and layer.ffn_down.native is None
    assert layer.ffn_down.packed is not None
    for step in (1, len(tokens)):  # decode rows (int4pack) and a prompt (dense float32 GEMMs)
        got = logits(model, tokens, step)
        err = (got - want).abs().max() / want.abs().max()
        assert float(err) < 0.03, (step, float(err))
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_the_portable_build_runs_the_model_with_no_float_copy(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain C build (a CPU without AVX2 or NEON) end to end: a prompt takes its panel
    kernel, so no matrix gets a float32 copy, and over an f32 cache its logits are the native
    build's up to the order of float additions (benchmarks/portable_logits.py does the same on
    real models). A half or bfloat16 cache rounds each K and V value, and a last-bit difference
    moves some across a rounding step (2^-11 of the value for a half), which the int8 activation
    steps downstream amplify: over the default f16 cache the builds differ as int8 activations
    make any two orders of addition differ (6.8e-3 of the largest logit measured here), so there
    they are held to the bound this file sets for int8 activations."""
    cc = cpu_lib._compiler()
    path = cpu_lib.build(cc, portable=True) if cc else None
    portable = cpu_lib.load(path) if path is not None else None
    if portable is None:
        pytest.skip("no portable build")
    tokens = ([1, 5, 9, 3, 7, 11, 4, 8, 2, 6] * 8)[: 2 * (QUANT_MAX_ROWS + 1)]
    runs = [(1, "f32"), (len(tokens), "f32"), (1, "f16"), (len(tokens), "f16")]
    native = Model(model_path)
    want = [logits(native, tokens, step, cache) for step, cache in runs]
    monkeypatch.setattr(cpu_lib, "lib", lambda: portable)
    model = Model(model_path)
    got = [logits(model, tokens, step, cache) for step, cache in runs]
    layer = model.impl.layers[0]
    for linear in (layer.ffn_down, layer.wo, model.impl.output):
        assert isinstance(linear, QuantLinear) and linear.native is not None and linear._dense is None
    for (step, cache), g, w in zip(runs, got, want, strict=True):
        err = (g - w).abs().max() / w.abs().max()
        assert float(err) < (1e-5 if cache == "f32" else 0.03), (step, cache, float(err))
        assert torch.equal(g.argmax(-1), w.argmax(-1))
