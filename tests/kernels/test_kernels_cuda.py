"""The Triton kernels compiled on a CUDA GPU against their references (tests/kernels/
device_checks.py), in a process without TRITON_INTERPRET; and those checks themselves under
the interpreter, so that they run wherever the suite runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernels import device_checks


@pytest.mark.parametrize("check", device_checks.CHECKS, ids=lambda c: c.__name__)
def test_checks_run_under_the_interpreter(check) -> None:  # type: ignore[no-untyped-def]
    check("cpu", quick=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernels_compiled_on_cuda_match_their_references() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tests.kernels.device_checks import check_all; check_all('cuda')"
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count(": ok on cuda") == len(device_checks.CHECKS)
