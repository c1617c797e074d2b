"""benchmarks/random_weights.py: a model-shaped file rebuilt from its header alone (the data
truncated away, then zeros), with random weights of each tensor's own type, loads and runs."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

import kvtool
from tests.helpers.quantized import quantizing
from tests.helpers.tiny_gguf import write_tiny_llama

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "random_weights.py"
_spec = importlib.util.spec_from_file_location("random_weights", SCRIPT)
assert _spec is not None and _spec.loader is not None
random_weights = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(random_weights)


@pytest.fixture
def header_only(tmp_path: Path) -> tuple[Path, int]:
    """A tiny llama with Q4_1 and Q8_0 matrices, cut to its header and extended with zeros."""
    with quantizing(lambda name: T.Q8_0 if name.startswith("token_embd") else T.Q4_1):
        src = write_tiny_llama(tmp_path / "src.gguf")
    size = src.stat().st_size
    out = tmp_path / "model.gguf"
    with src.open("rb") as f, out.open("wb") as g:
        g.write(f.read(gguf.GGUFReader(src).data_offset))
        g.truncate(size)
    return out, size


def test_every_tensor_gets_finite_random_values(header_only: tuple[Path, int]) -> None:
    path, size = header_only
    assert random_weights.main([str(path)]) == 0
    assert path.stat().st_size == size
    tensors = gguf.GGUFReader(path).tensors
    assert {t.tensor_type for t in tensors} >= {T.F32, T.Q4_1, T.Q8_0}
    for t in tensors:
        x = dequantize(np.asarray(t.data), t.tensor_type)
        assert np.isfinite(x).all() and x.std() > 0, t.name
        if len(t.shape) == 1:  # norms around 1, matrices around 0
            assert abs(float(x.mean()) - 1.0) < 0.2, t.name
        else:
            assert abs(float(x.mean())) < 0.01 and 0.005 < float(x.std()) < 0.05, t.name
    ctx = kvtool.Context(kvtool.Model(path), kvtool.ContextParams(n_ctx=64, n_seq_max=1))
    logits = kvtool.decode_tokens(ctx, [1, 2, 3], 0, 0)
    assert bool(logits.isfinite().all()) and float(logits.std()) > 0


def test_the_same_seed_gives_the_same_file(header_only: tuple[Path, int], tmp_path: Path) -> None:
    path, _ = header_only
    twin = tmp_path / "twin.gguf"
    shutil.copy(path, twin)
    assert random_weights.main([str(path), "--seed", "3"]) == 0
    assert random_weights.main([str(twin), "--seed", "3"]) == 0
    assert path.read_bytes() == twin.read_bytes()


def test_a_cut_file_is_one_error_line(
    header_only: tuple[Path, int], capsys: pytest.CaptureFixture[str]
) -> None:
    path, size = header_only
    with path.open("r+b") as f:
        f.truncate(size - 100)  # the last tensor's data runs past the end
    assert random_weights.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count("\n") == 1
