"""wkv6: its recurrence written out in float64 and its inputs (test_wkv.py checks the references
and the Triton kernel with them), and the decays only RWKV-6 has."""

from __future__ import annotations

import torch

from kvtool.kernels.wkv6 import wkv6_chunked_ref, wkv6_ref


def naive_wkv6(r, k, v, w_log, u, state):  # type: ignore[no-untyped-def]
    """ggml's rwkv_wkv6 loop, token by token, in float64: state S[key i, value j]. Returns the
    outputs and the state after every token [B, T, H, N, N]."""
    B, T, H, N = r.shape
    s = state.double().clone()
    out = torch.zeros(B, T, H, N, dtype=torch.float64)
    states = []
    for t in range(T):
        for i in range(N):
            kv = k[:, t, :, i, None].double() * v[:, t].double()  # [B, H, N(value)]
            out[:, t] += r[:, t, :, i, None].double() * (u[None, :, i, None].double() * kv + s[:, :, i])
            s[:, :, i] = torch.exp(w_log[:, t, :, i, None].double()) * s[:, :, i] + kv
        states.append(s.clone())
    return out, torch.stack(states, dim=1)


def make_inputs(B: int, T: int, H: int, N: int, seed: int, decay_scale: float = 1.0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, generator=g) for _ in range(3))
    # RWKV-6's decay: w = exp(-exp(x)), x around the init ramp [-6, -1] plus data.
    w_log = -torch.exp(
        decay_scale * (torch.rand(B, T, H, N, generator=g) * 5 - 6 + torch.randn(B, T, H, N, generator=g))
    )
    u = torch.randn(H, N, generator=g)
    state = torch.randn(B, H, N, N, generator=g)
    return r, k, v, w_log, u, state


# what test_wkv checks the references with: shapes [B, T, H, N] and chunk lengths
SHAPES = [(1, 1, 1, 16), (2, 5, 3, 16), (1, 33, 2, 8), (3, 70, 2, 16), (1, 40, 1, 64)]
CHUNKS = [1, 7, 16, 64]


def test_extreme_decay_stays_finite() -> None:
    # w_log = -1e4 (w underflows to 0) next to w_log = -1e-9 (w rounds to 1): the chunked form
    # only ever exponentiates sums of log-decays, so nothing overflows.
    r, k, v, w_log, u, s0 = make_inputs(1, 40, 2, 16, seed=4)
    w_log = torch.where(
        torch.rand(w_log.shape) < 0.5, torch.full_like(w_log, -1e4), torch.full_like(w_log, -1e-9)
    )
    out, state = wkv6_ref(r, k, v, w_log, u, s0)
    want_out, _ = naive_wkv6(r, k, v, w_log, u, s0)
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    torch.testing.assert_close(out.double(), want_out, atol=1e-3, rtol=1e-5)


def test_strong_decay_then_weak_keeps_precision() -> None:
    # One token decays every channel to ~0 (w_log -1e4), the following ones barely decay: the
    # weak decays between later tokens must not drown in the cumulative sum of the strong one.
    r, k, v, _, u, s0 = make_inputs(1, 64, 2, 16, seed=4)
    w_log = torch.full(r.shape, -1e-3)
    w_log[:, 0], w_log[:, 32] = -1e4, -3e4
    out, state = wkv6_chunked_ref(r, k, v, w_log, u, s0)
    want_out, want_states = naive_wkv6(r, k, v, w_log, u, s0)
    scale = want_out.abs().max().item()
    torch.testing.assert_close(out.double() / scale, want_out / scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(state.double(), want_states[:, -1], atol=1e-4, rtol=1e-5)
