"""kernels/rms_norm_cpu.py: ggml's RMS norm (the sum of squares in double) on the CPU against its
specification, qmatmul.rms_norm_ref."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels import cpu_lib
from kvtool.kernels.qmatmul import rms_norm_ref
from kvtool.kernels.rms_norm_cpu import applies, rms_norm_cpu

pytestmark = pytest.mark.skipif(cpu_lib.lib() is None, reason="no C compiler: the kernel is not built")


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 32), (7, 1000)])
def test_matches_the_specification(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[-1])
    w = torch.rand(shape[-1]) + 0.5
    got, want = rms_norm_cpu(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=2e-7, atol=0)
    assert (got == want).float().mean() > 0.99  # the same float ops: bits but for a rare double rounding


def test_what_it_does_not_take() -> None:
    x = torch.randn(2, 8)
    assert applies(x, torch.ones(8))
    assert not applies(x, torch.ones(4)) and not applies(x.double(), torch.ones(8))
