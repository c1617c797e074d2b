"""Mamba-1 selective scan: the chunked reference against the token-by-token recurrence, and
the Triton kernel against the reference (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels.ssm_scan import (
    softplus,
    ssm_scan_ref,
    ssm_scan_step_ref,
    ssm_scan_step_triton,
    ssm_scan_triton,
)


def case(S: int, T: int, D: int, N: int, seed: int, spike: bool = True):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(S, D, N, generator=g)
    x = torch.randn(S, T, D, generator=g)
    dt = torch.randn(S, T, D, generator=g) * 2 - 1  # softplus from ~0.05 to ~3
    if spike:  # above ggml's softplus threshold (dt itself), and a decay that forces 1-token chunks
        dt[0, 0, 0] = 25.0
    A = -torch.rand(D, N, generator=g) * 8
    B = torch.randn(S, T, N, generator=g)
    C = torch.randn(S, T, N, generator=g)
    return s, x, dt, A, B, C


def naive(s, x, dt, A, B, C):  # type: ignore[no-untyped-def]
    """The recurrence, one token at a time, in float64."""
    h = s.double()
    ys, hs = [], []
    for t in range(x.shape[1]):
        d = softplus(dt[:, t].double())[:, :, None]
        h = torch.exp(d * A.double()) * h + d * x[:, t, :, None].double() * B[:, t, None, :].double()
        ys.append((h * C[:, t, None, :].double()).sum(-1))
        hs.append(h)
    return torch.stack(ys, 1), torch.stack(hs, 1)


@pytest.mark.parametrize(
    ("S", "T", "D", "N", "n_states", "spike"),
    [(1, 1, 8, 4, 1, True), (2, 37, 24, 16, 5, True), (3, 70, 16, 8, 1, False), (1, 200, 8, 16, 3, False)],
)
def test_reference_is_the_recurrence(S: int, T: int, D: int, N: int, n_states: int, spike: bool) -> None:
    # without the spike, chunks span many tokens (the decay per token is at most ~25)
    s, x, dt, A, B, C = case(S, T, D, N, T, spike)
    y, states = ssm_scan_ref(s, x, dt, A, B, C, n_states)
    y0, h0 = naive(s, x, dt, A, B, C)
    torch.testing.assert_close(y.double(), y0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states.double(), h0[:, T - n_states :], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("S", "T", "D", "N", "n_states", "block_d"),
    [(1, 1, 8, 16, 1, None), (2, 19, 40, 16, 4, 16), (3, 9, 24, 12, 9, None)],
)
def test_triton_matches_reference(S: int, T: int, D: int, N: int, n_states: int, block_d: int | None) -> None:
    s, x, dt, A, B, C = case(S, T, D, N, S * T + D)
    y, states = ssm_scan_triton(s, x, dt, A, B, C, n_states, block_d=block_d)
    y0, states0 = ssm_scan_ref(s, x, dt, A, B, C, n_states)
    torch.testing.assert_close(y, y0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, states0, rtol=1e-4, atol=1e-4)


def test_triton_step_matches_reference() -> None:
    s, x, dt, A, B, C = case(2, 1, 24, 16, 3)
    got = ssm_scan_step_triton(s, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    want = ssm_scan_step_ref(s, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
