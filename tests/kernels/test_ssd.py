"""Mamba-2 scan: the chunked SSD reference against the token-by-token recurrence, and the
Triton kernel against the reference (TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

from kvtool.kernels.ssd import CHUNK, softplus, ssd_ref, ssd_step_ref, ssd_step_triton, ssd_triton


def case(S: int, T: int, H: int, P: int, G: int, N: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(S, H, P, N, generator=g)
    x = torch.randn(S, T, H, P, generator=g)
    dt = torch.randn(S, T, H, generator=g) * 2 - 1
    dt[0, 0, 0] = 25.0  # above ggml's softplus threshold
    A = -1 - torch.rand(H, generator=g) * 15
    B = torch.randn(S, T, G, N, generator=g)
    C = torch.randn(S, T, G, N, generator=g)
    return s, x, dt, A, B, C


def naive(s, x, dt, A, B, C):  # type: ignore[no-untyped-def]
    """The recurrence, one token and one head at a time, in float64 (head h reads group
    h // (n_head / n_group))."""
    S, T, H, P = x.shape
    per = H // B.shape[2]
    h = s.double().clone()
    ys = torch.zeros(S, T, H, P, dtype=torch.float64)
    hs = []
    for t in range(T):
        for hd in range(H):
            g = hd // per
            d = softplus(dt[:, t, hd].double())[:, None, None]
            h[:, hd] = (
                torch.exp(d * A[hd].double()) * h[:, hd]
                + d * x[:, t, hd, :, None].double() * B[:, t, g, None, :].double()
            )
            ys[:, t, hd] = (h[:, hd] * C[:, t, g, None, :].double()).sum(-1)
        hs.append(h.clone())
    return ys, torch.stack(hs, 1)


@pytest.mark.parametrize(
    ("S", "T", "H", "P", "G", "N", "n_states"),
    [
        (1, 1, 2, 4, 1, 8, 1),
        (2, 29, 4, 8, 2, 16, 6),
        (2, CHUNK + 3, 4, 4, 4, 8, 5),
        (1, 2 * CHUNK, 8, 4, 2, 8, 1),
    ],
)
def test_reference_is_the_recurrence(S: int, T: int, H: int, P: int, G: int, N: int, n_states: int) -> None:
    s, x, dt, A, B, C = case(S, T, H, P, G, N, T + H)
    y, states = ssd_ref(s, x, dt, A, B, C, n_states)
    y0, h0 = naive(s, x, dt, A, B, C)
    torch.testing.assert_close(y.double(), y0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states.double(), h0[:, T - n_states :], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("S", "T", "H", "P", "G", "N", "n_states", "block_p"),
    [(1, 1, 2, 16, 1, 16, 1, None), (2, 13, 4, 24, 2, 12, 3, 8), (3, 7, 6, 8, 3, 16, 7, None)],
)
def test_triton_matches_reference(S, T, H, P, G, N, n_states, block_p) -> None:  # type: ignore[no-untyped-def]
    s, x, dt, A, B, C = case(S, T, H, P, G, N, S + T + P)
    y, states = ssd_triton(s, x, dt, A, B, C, n_states, block_p=block_p)
    y0, states0 = ssd_ref(s, x, dt, A, B, C, n_states)
    torch.testing.assert_close(y, y0, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, states0, rtol=1e-4, atol=1e-4)


def test_triton_step_matches_reference() -> None:
    s, x, dt, A, B, C = case(2, 1, 4, 16, 2, 16, 9)
    got = ssd_step_triton(s, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    want = ssd_step_ref(s, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
