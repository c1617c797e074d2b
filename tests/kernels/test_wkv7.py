"""wkv7: its delta-rule recurrence written out in float64 and its inputs (test_wkv.py checks the
references and the Triton kernel with them), and a long prompt through the triangular solves."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtool.kernels.wkv7 import wkv7_ref


def naive_wkv7(r, w_log, k, v, a, b, state):  # type: ignore[no-untyped-def]
    """ggml's rwkv_wkv7 loop, token by token, in float64: state S[value i, key j]. Returns the
    outputs and the state after every token [B, T, H, N, N]."""
    B, T, H, N = r.shape
    s = state.double().clone()
    out = torch.zeros(B, T, H, N, dtype=torch.float64)
    r, w_log, k, v, a, b = (x.double() for x in (r, w_log, k, v, a, b))
    states = []
    for t in range(T):
        for i in range(N):
            sa = (a[:, t] * s[:, :, i]).sum(-1, keepdim=True)  # [B, H, 1]
            s[:, :, i] = s[:, :, i] * torch.exp(w_log[:, t]) + v[:, t, :, i, None] * k[:, t] + sa * b[:, t]
            out[:, t, :, i] = (s[:, :, i] * r[:, t]).sum(-1)
        states.append(s.clone())
    return out, torch.stack(states, dim=1)


def make_inputs(B: int, T: int, H: int, N: int, seed: int):  # type: ignore[no-untyped-def]
    """RWKV-7's operands: a = -kk and b = kk * iclr with kk of unit norm per head."""
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(B, T, H, N, generator=g) for _ in range(3))
    w_log = -0.606531 * torch.sigmoid(2 * torch.randn(B, T, H, N, generator=g))
    kk = F.normalize(torch.randn(B, T, H, N, generator=g), dim=-1)
    iclr = torch.sigmoid(torch.randn(B, T, H, N, generator=g))
    state = torch.randn(B, H, N, N, generator=g)
    return r, w_log, k, v, -kk, kk * iclr, state


# what test_wkv checks the references with: shapes [B, T, H, N] and chunk lengths
SHAPES = [(1, 1, 1, 16), (2, 5, 3, 16), (1, 33, 2, 8), (3, 40, 2, 16), (1, 37, 1, 64)]
CHUNKS = [1, 5, 16, 32]


def test_long_prompt_stays_bounded() -> None:
    # The delta rule keeps the state bounded; the chunked triangular solves must not amplify
    # rounding over many chunks.
    args = make_inputs(1, 300, 1, 16, seed=8)
    want_out, _ = naive_wkv7(*args)
    out, state = wkv7_ref(*args)
    assert torch.isfinite(state).all()
    scale = max(1.0, want_out.abs().max().item())
    torch.testing.assert_close(out.double() / scale, want_out / scale, atol=1e-5, rtol=0)
