"""The whole engine on a CUDA GPU (tests/kvtool/device_engine_checks.py), in a process without
TRITON_INTERPRET so that the kernels are compiled: llama.cpp's tiny scenarios and the CPU
engine's logits, seeded sampling, and SmolLM2's greedy tokens (a real model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _run_on_cuda(check: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from tests.kvtool.device_engine_checks import {check}; {check}('cuda'); print('ok')"
    root = Path(__file__).parents[2]
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=1800
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_tiny_scenarios_on_cuda() -> None:
    assert _run_on_cuda("check_tiny_scenarios").strip().endswith("ok")


def test_seeded_sampling_on_cuda() -> None:
    assert _run_on_cuda("check_seeded_sampling").strip().endswith("ok")


def test_decode_graphs_on_cuda() -> None:
    assert _run_on_cuda("check_decode_graphs").strip().endswith("ok")


@pytest.mark.real
def test_smollm2_greedy_on_cuda() -> None:
    assert _run_on_cuda("check_smollm2_greedy").strip().endswith("ok")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kvtool.commands", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)


def test_verbs_on_cuda(tiny_llama_path: Path) -> None:
    m = str(tiny_llama_path)
    base = ["run", "-m", m, "-p", "the cat", "-n", "8", "--temp", "0", "--no-chat", "--weights", "f32"]
    cpu, gpu = _cli(*base), _cli(*base, "--device", "cuda")
    assert cpu.returncode == 0 and gpu.returncode == 0, gpu.stderr
    assert gpu.stdout == cpu.stdout  # greedy tokens
    assert _cli(*base, "-ngl", "99").stdout == cpu.stdout
    bench = _cli("bench", "-m", m, "-p", "16", "-n", "4", "-r", "1", "-ngl", "99", "--no-progress")
    assert bench.returncode == 0 and "CUDA" in bench.stdout, bench.stderr
    bb = _cli("batched-bench", "-m", m, "-npp", "16", "-ntg", "4", "-npl", "1,2", "--device", "cuda")
    assert bb.returncode == 0, bb.stderr
