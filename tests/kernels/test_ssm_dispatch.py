"""Dispatch and compilation of the Mamba kernels: CPU tensors take the torch reference (the
step form for one token), tensors `use_triton` accepts reach the Triton kernel with the
caller's arguments, and every kernel compiles for sm_90 ahead of time (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtool.kernels import ssd as ssd_mod
from kvtool.kernels import ssm_scan as scan_mod
from tests.kernels import test_ssd, test_ssm_scan
from tests.kernels.sm90 import compile_in_subprocess, compile_sm90


def _scan_inputs(T: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(T)
    S, D, N = 2, 8, 4
    return (
        torch.randn(S, D, N, generator=g),
        torch.randn(S, T, D, generator=g),
        torch.randn(S, T, D, generator=g),
        -torch.rand(D, N, generator=g),
        torch.randn(S, T, N, generator=g),
        torch.randn(S, T, N, generator=g),
    )


def _ssd_inputs(T: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(T)
    S, H, P, G, N = 2, 4, 4, 2, 8
    return (
        torch.randn(S, H, P, N, generator=g),
        torch.randn(S, T, H, P, generator=g),
        torch.randn(S, T, H, generator=g),
        -torch.rand(H, generator=g),
        torch.randn(S, T, G, N, generator=g),
        torch.randn(S, T, G, N, generator=g),
    )


CASES = [(scan_mod, "ssm_scan", _scan_inputs), (ssd_mod, "ssd", _ssd_inputs)]


def _refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise AssertionError("this path must not be taken")


@pytest.mark.parametrize(("mod", "name", "inputs"), CASES, ids=["ssm_scan", "ssd"])
def test_cpu_tensors_take_the_reference(mod, name, inputs, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(mod, f"{name}_triton", _refuse)
    y, h = getattr(mod, name)(*inputs(5), 2)
    y0, h0 = getattr(mod, f"{name}_ref")(*inputs(5), 2)
    assert torch.equal(y, y0) and torch.equal(h, h0)
    monkeypatch.setattr(mod, f"{name}_ref", _refuse)  # one token: the step form
    y, h = getattr(mod, name)(*inputs(1))
    assert y.shape[1] == 1 and h.shape[1] == 1


@pytest.mark.parametrize(("mod", "name", "inputs"), CASES, ids=["ssm_scan", "ssd"])
def test_accepted_tensors_take_the_kernel(mod, name, inputs, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    calls = []
    kernel = getattr(mod, f"{name}_triton")

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(mod, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(mod, f"{name}_triton", spy)
    monkeypatch.setattr(mod, f"{name}_ref", _refuse)
    for T in (1, 3):
        y, h = getattr(mod, name)(*inputs(T), T)
        y0, h0 = kernel(*inputs(T), T)
        assert torch.equal(y, y0) and torch.equal(h, h0)
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("mod", "name", "tests", "shape"),
    [
        (scan_mod, "ssm_scan", test_ssm_scan, (3, 1, 16, 8, 7)),  # S, T, D, N, seed
        (ssd_mod, "ssd", test_ssd, (3, 1, 4, 8, 2, 16, 5)),  # S, T, H, P, G, N, seed
    ],
    ids=["ssm_scan", "ssd"],
)
def test_step_is_one_token_of_the_scan(mod, name, tests, shape) -> None:  # type: ignore[no-untyped-def]
    s, x, dt, A, B, C = tests.case(*shape)
    y, h = getattr(mod, f"{name}_step_ref")(s, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    y0, h0 = tests.naive(s, x, dt, A, B, C)
    torch.testing.assert_close(y.double(), y0[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), h0[:, 0], rtol=1e-5, atol=1e-5)
    y1, h1 = getattr(mod, name)(s, x, dt, A, B, C)  # the dispatcher takes the step form
    assert torch.equal(y1[:, 0], y) and torch.equal(h1[:, 0], h)


def compile_all() -> None:  # runs in `compile_in_subprocess`
    for fn, constexprs in (
        (scan_mod._ssm_scan_kernel, dict(BLOCK_D=64, BLOCK_N=16)),
        (ssd_mod._ssd_kernel, dict(BLOCK_P=64, BLOCK_N=128)),
    ):
        signature = {name: "*fp32" if name.endswith("_ptr") else "i32" for name in fn.arg_names}
        signature |= {name: "constexpr" for name in constexprs}
        compile_sm90(fn, signature, constexprs)


def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    compile_in_subprocess("tests.kernels.test_ssm_dispatch", "compile_all", tmp_path)
