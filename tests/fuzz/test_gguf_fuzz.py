"""Fuzzing of the GGUF loader (issue 14): mutated copies of the eight tiny models (truncated at
every section boundary, bit flips, oversized counts and lengths, wrong value and tensor types,
changed hyper-parameters and tensor dims, offsets past the end) either load and decode a token
or raise a KvtoolError: never another exception, and never an allocation beyond what the file
justifies (the address space is capped while the cases run, so such an allocation fails).

This is the bounded, seeded CI run; `benchmarks/fuzz_gguf.py` runs every case and random bit
flips for as long as asked."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.fuzz.gguf_contents import bpe_base, check, content_cases, exercise
from tests.fuzz.gguf_mutations import all_cases, capped_address_space, load_and_decode

MODELS = Path(__file__).parent.parent / "data" / "tiny" / "models"
ARCHS = ["llama", "gemma3", "mamba", "mamba2", "rwkv6", "rwkv7", "granitehybrid", "lfm2"]
CASES_PER_MODEL = 32  # 256 in all: a few seconds on an idle machine


@pytest.mark.parametrize("arch", ARCHS)
def test_mutated_gguf_loads_or_fails_in_one_line(arch: str, tmp_path: Path) -> None:
    rng = random.Random(f"gguf-fuzz-{arch}")
    cases = list(all_cases(MODELS / f"tiny-{arch}.gguf", rng, n_random=CASES_PER_MODEL // 4))
    sample = rng.sample(cases, CASES_PER_MODEL)
    outcomes = []
    with capped_address_space():
        for i, case in enumerate(sample):
            path = tmp_path / f"case{i}.gguf"
            path.write_bytes(case.data())
            try:
                outcomes.append(load_and_decode(path))
            except Exception as e:  # the defect: anything but a KvtoolError
                pytest.fail(f"{arch} {case.name}: {type(e).__name__}: {e}")
            path.unlink()
    assert any(o.startswith("error:") for o in outcomes)
    assert all("\n" not in o for o in outcomes)


QUANT_MODELS = MODELS.parent.parent / "quant" / "models"
# per model: a sample of its few hundred cases (fewer where the model adds an architecture or a
# weight type to the first five), and every hidden-NaN case
CONTENT_ARCHS = [("llama", 40), ("bpe", 40), ("gemma3", 40), ("mamba", 40), ("granitehybrid", 40)]
CONTENT_ARCHS += [(a, 10) for a in ("qwen2", "qwen3", "phi3", "gemma2", "granite", "olmo2")]
CONTENT_ARCHS += [(f"q-{t}", 6) for t in ("Q2_K", "Q3_K_S", "IQ4_NL", "IQ4_XS")]  # block scales


@pytest.mark.parametrize(("arch", "n_cases"), CONTENT_ARCHS)
def test_mutated_contents_work_or_fail_in_one_line(arch: str, n_cases: int, tmp_path: Path) -> None:
    """Valid files with hostile contents (tests/fuzz/gguf_contents.py): metadata of other types,
    odd token texts and types, hostile templates, NaN and infinite weights (a quantized block's
    scale)."""
    if arch == "bpe":
        base = bpe_base(MODELS / "tiny-llama.gguf", tmp_path / "bpe.gguf")
    else:
        base = (QUANT_MODELS if arch.startswith("q-") else MODELS) / f"tiny-{arch}.gguf"
    rng = random.Random(f"gguf-contents-{arch}")
    cases = list(content_cases(base, rng))
    sample = rng.sample(cases, n_cases) + [c for c in cases if c.hides_nan]
    attention = arch != "mamba"
    outcomes = []
    with capped_address_space():
        for case in sample:
            path = case.write(base, tmp_path / "case.gguf")
            try:
                outcome = exercise(path, attention)
            except Exception as e:  # the defect: anything but a KvtoolError
                pytest.fail(f"{arch} {case.name}: {type(e).__name__}: {e}")
            defect = check(case, outcome, attention)
            assert defect is None, f"{arch} {case.name}: {defect}"
            outcomes.append(outcome)
    assert any(o.startswith("error:") for o in outcomes) and "ok" in outcomes
