"""What wkv6 and wkv7 share: the reference's split into a chunked prompt and trailing steps, and
the Triton launch (checks, f32 state buffers, grid). Both keep a state [n_seqs, n_head, N, N]
per head and take per-token operands [n_seqs, n_tokens, n_head, N]."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._triton import triton

Result = tuple[torch.Tensor, torch.Tensor]  # (out, state or states)


def trailing_states_ref(
    step: Callable[..., Result],
    chunked: Callable[..., Result],
    xs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    state: torch.Tensor,
    n_states: int,
) -> Result:
    """The chunked form up to the first of the trailing `n_states` tokens, then the step form for
    the others (a single token takes the step form only). `step` and `chunked` take the per-token
    operands `xs` [B, T, H, N] sliced to a span of tokens, the per-head `params`, the state."""
    T = xs[0].shape[1]
    assert 1 <= n_states <= T, (n_states, T)
    n0 = T - n_states + 1

    def span(t0: int, t1: int) -> list[torch.Tensor]:
        return [x[:, t0:t1] for x in xs]

    out, s = step(*span(0, 1), *params, state) if n0 == 1 else chunked(*span(0, n0), *params, state)
    outs, states = [out], [s]
    for t in range(n0, T):
        out, s = step(*span(t, t + 1), *params, s)
        outs.append(out)
        states.append(s)
    return torch.cat(outs, dim=1), torch.stack(states, dim=1)


def launch(
    kernel: Any,  # a @triton.jit function
    xs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    state: torch.Tensor,
    n_states: int,
    out_dtype: torch.dtype,
    max_bv: int,
) -> Result:
    """Runs a wkv kernel taking (*xs, *params, state in, out, states out, T, H, N, n_states, BK,
    BV) over a grid of (sequence x head, block of BV state columns). Returns out [B, T, H, N] in
    `out_dtype` and the trailing f32 states [B, n_states, H, N, N]."""
    B, T, H, N = xs[0].shape
    for x in xs:
        assert x.shape == (B, T, H, N), (xs[0].shape, x.shape)
    assert state.shape == (B, H, N, N), state.shape
    assert 1 <= n_states <= T, (n_states, T)
    assert all(x.device == state.device for x in (*xs, *params))
    xs, params = [x.contiguous() for x in xs], [p.contiguous() for p in params]
    s_in = state.float().contiguous()
    out = torch.empty(B, T, H, N, dtype=out_dtype, device=state.device)
    s_out = torch.empty(B, n_states, H, N, N, dtype=torch.float32, device=state.device)
    if B * H == 0:
        return out, s_out
    bk = max(16, triton.next_power_of_2(N))
    bv = min(bk, max_bv)
    grid = (B * H, triton.cdiv(N, bv))
    kernel[grid](*xs, *params, s_in, out, s_out, T, H, N, n_states, BK=bk, BV=bv)
    return out, s_out
