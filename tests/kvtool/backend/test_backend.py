"""The backend (kvtool/backend): the implementation of each op chosen once at model load, by
name ("CPU (AVX2)"...), and `compiled=False`, torch for every op on the CPU (the reference the
compiled kernels are checked against)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from kvtool import Model
from kvtool.backend.linear import QuantLinear
from kvtool.kernels import attention_cpu, cpu_lib, qmatmul, rms_norm_cpu, rope_store_cpu
from kvtool.kernels.decoder_cpu import DecoderWeights
from tests.helpers import tiny_gguf
from tests.helpers.quantized import logits, quantizing


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny llama with Q4_1 matrices (the compiled matmul's and int4pack's) and Q8_0 ends."""
    qtype = lambda name: T.Q8_0 if name in ("token_embd.weight", "output.weight") else T.Q4_1  # noqa: E731
    with quantizing(qtype):
        return tiny_gguf.write_tiny_llama(Path(tmp_path_factory.mktemp("q")) / "tiny-q4_1.gguf")


def test_the_backend_is_named_by_the_kernels_that_compute(model_path: Path) -> None:
    """llama-bench's backend name, with the compiled kernels' instruction set."""
    auto, exact = Model(model_path), Model(model_path, weights="f32")
    reference = Model(model_path, compiled=False)
    assert reference.backend.name == "CPU (torch)" and not reference.backend.compiled
    if cpu_lib.lib() is None:
        assert auto.backend.name == exact.backend.name == "CPU (torch)"
        return
    # the f32 mode still norms, rotates and attends with the compiled kernels: it says so
    assert auto.backend == exact.backend.__class__(auto.device, "auto", cpu_lib.simd())
    assert exact.backend.compiled and exact.backend.isa == cpu_lib.simd()
    names = {"avx2": "CPU (AVX2)", "avx512-vnni": "CPU (AVX512 VNNI)", "portable": "CPU (portable)"}
    names |= {"neon": "CPU (NEON)", "neon-dotprod": "CPU (NEON dotprod)"}
    assert auto.backend.name == names[cpu_lib.simd()]


def test_compiled_false_runs_no_compiled_kernel(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `compiled=False` nothing of the compiled kernels computes (each entry point would
    fail the test): the Q4_1 matrices go to torch's int4pack, attention, RoPE and norms to torch,
    and the logits stay those of the float32 weights (int4pack's bfloat16 activations are the
    difference), prompt and decode."""
    exact = Model(model_path, weights="f32", compiled=False)
    model = Model(model_path, compiled=False)
    assert model.impl.decoder is None
    down = model.impl.layers[0].ffn_down
    assert isinstance(down, QuantLinear) and down.native is None and down.packed is not None

    def refuse(*args: object) -> None:
        raise AssertionError("a compiled kernel ran")

    monkeypatch.setattr(qmatmul.QWeight, "__call__", refuse)
    monkeypatch.setattr(qmatmul, "ffn_glu", refuse)
    monkeypatch.setattr(attention_cpu, "attention_cpu", refuse)
    monkeypatch.setattr(rope_store_cpu, "rope_store", refuse)
    monkeypatch.setattr(rms_norm_cpu, "rms_norm_cpu", refuse)
    monkeypatch.setattr(DecoderWeights, "run", refuse)
    tokens = [1, 5, 9, 3, 7, 11, 4, 8, 2, 6, 12, 10]
    want = logits(exact, tokens, 1)
    for step in (1, len(tokens)):  # decode rows (int4pack) and a prompt (dense float32 GEMMs)
        got = logits(model, tokens, step)
        err = (got - want).abs().max() / want.abs().max()
        assert float(err) < 0.03, (step, float(err))
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
