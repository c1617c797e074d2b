"""benchmarks/gpu_kernels.py: its arguments, its one-line refusal without a GPU (or under the
interpreter), its table; on a GPU, a short run."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_kernels.py"
_spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["gpu_kernels"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_defaults_are_issue_13s_table() -> None:
    a = bench.parse_args([])
    assert [(c.n_stream, c.n_q, c.n_kv) for c in a.case_list] == [
        (1, 1, 4096),
        (1, 1, 32768),
        (16, 1, 4096),
        (64, 1, 2048),
        (1, 4096, 4096),
    ]
    assert (a.heads, a.kv_heads, a.head_dim, a.dtype) == (32, 8, 128, "fp16")
    assert bench.parse_args(["--cases", "prompt-4k,decode-1x4k"]).case_list == [
        CASES["prompt-4k"],
        CASES["decode-1x4k"],
    ]


CASES = {c.name: c for c in bench.CASES}


@pytest.mark.parametrize(
    ("argv", "msg"),
    [
        (["--cases", "decode-1x4k,huge"], "unknown case(s) huge"),
        (["--heads", "30", "--kv-heads", "8"], "--heads must be a positive multiple of --kv-heads"),
        (["--head-dim", "512"], "--head-dim must be between 16 and 256"),
        (["--reps", "0"], "--reps must be at least 1"),
        (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    ],
)
def test_bad_arguments_are_refused(argv: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_refuses_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET is set" in bench.cuda_refusal()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_in_one_line_without_a_gpu() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: benchmarks/gpu_kernels.py needs a CUDA GPU (torch ")


def test_table_rows() -> None:
    decode = {"case": "decode, 1 stream, 4k cells", "kvtool_cells_ms": 0.5, "kvtool_mask_ms": 0.6}
    decode |= {"sdpa_ms": 0.25, "share_of_copy_bw": 0.123, "kvtool_cells_max_diff": 1e-3}
    decode |= {"kvtool_cells_graph_ms": 0.05, "sdpa_graph_ms": 0.02}
    prompt = {"case": "prompt", "kvtool_cells_ms": 1.0, "kvtool_mask_ms": 2.0, "sdpa_ms": 0.5}
    prompt |= {"sdpa_flash_ms": None, "kvtool_cells_tflops": 133.2, "share_of_peak": 0.134}
    prompt |= {"kvtool_cells_max_diff": 2e-3, "kvtool_cells_graph_ms": None, "sdpa_graph_ms": 0.4}
    lines = bench.table([decode, prompt], "head").splitlines()
    assert (
        lines[4] == "| decode, 1 stream, 4k cells | 0.500 ms | 0.600 ms | 0.250 ms | - | 0.050 ms | 0.020 ms "
        "| 12 % of copy bw | 1.0e-03 |"
    )
    assert (
        lines[5] == "| prompt | 1.000 ms | 2.000 ms | 0.500 ms | n/a | n/a | 0.400 ms "
        "| 133 TFLOP/s, 13 % of peak | 2.0e-03 |"
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_short_run_on_cuda(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["--cases", "decode-1x4k,prompt-4k", "--reps", "3", "--json", str(tmp_path / "r.json")]
    r = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, r.stderr
    assert "| decode, 1 stream, 4k cells |" in r.stdout and "| prompt, 4096 tokens, causal |" in r.stdout
    assert (tmp_path / "r.json").stat().st_size > 0
