"""Short convolution: the reference against the convolution written out token by token, and the
Triton kernel against the reference (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtool.kernels import short_conv as sc
from kvtool.kernels.short_conv import short_conv, short_conv_ref, short_conv_triton
from tests.kernels.sm90 import compile_in_subprocess, compile_sm90


def case(S: int, T: int, C: int, L: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(S, L - 1, C, generator=g),
        torch.randn(S, T, C, generator=g),
        torch.randn(C, L, generator=g),
        torch.randn(C, generator=g),
    )


def naive(state, x, w, b):  # type: ignore[no-untyped-def]
    """One token at a time in float64: a window of the last L inputs, shifted by each token."""
    T = x.shape[1]
    win = state.double().clone()  # [S, L - 1, C]
    ys, states = [], []
    for t in range(T):
        full = torch.cat([win, x[:, t : t + 1].double()], dim=1)  # [S, L, C]
        ys.append((full * w.double().T[None]).sum(1) + (0 if b is None else b.double()))
        win = full[:, 1:]
        states.append(win.clone())
    return torch.stack(ys, 1), torch.stack(states, 1)


@pytest.mark.parametrize(
    ("S", "T", "C", "L", "n_states"), [(1, 1, 4, 2, 1), (2, 9, 6, 3, 4), (3, 5, 8, 4, 5)]
)
@pytest.mark.parametrize("bias", [True, False])
def test_reference_is_the_windowed_sum(S: int, T: int, C: int, L: int, n_states: int, bias: bool) -> None:
    state, x, w, b = case(S, T, C, L, S + T + L)
    y, states = short_conv_ref(state, x, w, b if bias else None, n_states)
    y0, s0 = naive(state, x, w, b if bias else None)
    torch.testing.assert_close(y.double(), y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states.double(), s0[:, T - n_states :], rtol=0, atol=0)
    assert torch.equal(short_conv(state, x, w, b if bias else None, n_states)[0], y)


def test_a_prompt_in_two_pieces_is_the_prompt_at_once() -> None:
    state, x, w, b = case(2, 7, 5, 3, 1)
    y, s = short_conv_ref(state, x, w, b)
    y1, s1 = short_conv_ref(state, x[:, :3], w, b)
    y2, s2 = short_conv_ref(s1[:, 0], x[:, 3:], w, b)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-6, atol=1e-6)
    assert torch.equal(s2, s)


@pytest.mark.parametrize(
    ("S", "T", "C", "L", "n_states", "block_c", "bias"),
    [(1, 1, 4, 2, 1, None, False), (2, 9, 20, 3, 4, 8, False), (3, 6, 16, 4, 6, None, True)],
)
def test_triton_matches_reference(S, T, C, L, n_states, block_c, bias) -> None:  # type: ignore[no-untyped-def]
    state, x, w, b = case(S, T, C, L, S * T + C)
    y, states = short_conv_triton(state, x, w, b if bias else None, n_states, block_c=block_c)
    y0, states0 = short_conv_ref(state, x, w, b if bias else None, n_states)
    torch.testing.assert_close(y, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, states0, rtol=0, atol=0)


def _refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise AssertionError("this path must not be taken")


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors take the reference; tensors `use_triton` accepts reach the kernel."""
    state, x, w, b = case(2, 4, 8, 3, 3)
    monkeypatch.setattr(sc, "short_conv_triton", _refuse)
    y, s = sc.short_conv(state, x, w, b, 2)
    y0, s0 = short_conv_ref(state, x, w, b, 2)
    assert torch.equal(y, y0) and torch.equal(s, s0)
    monkeypatch.undo()
    calls = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        return short_conv_triton(*args, **kwargs)

    monkeypatch.setattr(sc, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(sc, "short_conv_triton", spy)
    monkeypatch.setattr(sc, "short_conv_ref", _refuse)
    y, s = sc.short_conv(state, x, w, None, 2)
    y0, s0 = short_conv_triton(state, x, w, None, 2)
    assert len(calls) == 1 and torch.equal(y, y0) and torch.equal(s, s0)


def compile_all() -> None:  # runs in `compile_in_subprocess`
    fn = sc._short_conv_kernel
    for bias in (True, False):
        constexprs = dict(HAS_BIAS=bias, BLOCK_C=128)
        signature = {name: "*fp32" if name.endswith("_ptr") else "i32" for name in fn.arg_names}
        signature |= {name: "constexpr" for name in constexprs}
        compile_sm90(fn, signature, constexprs)


def test_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    compile_in_subprocess("tests.kernels.test_short_conv", "compile_all", tmp_path)
