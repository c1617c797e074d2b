"""Mamba-1 selective scan (ggml's ssm_scan with a per-channel A): for each sequence, channel i
and state j,

    h[t, i, j] = exp(softplus(dt[t, i]) * A[i, j]) * h[t-1, i, j] + softplus(dt[t, i]) * x[t, i] * B[t, j]
    y[t, i]    = sum_j h[t, i, j] * C[t, j]

`dt` already carries its bias; softplus is ggml's (identity above 20). The D skip and the gate
are the model's. Prompts run as cumulative sums over chunks of tokens (a parallel scan of the
linear recurrence); the chunk length is chosen from the data so no exponent overflows.
"""

from __future__ import annotations

import torch

from ._scan import f32_operands, scan_ref, softplus, step_of
from ._triton import jit, tl, triton, use_triton

_LOG_RANGE = 60.0  # the most decay (in log) one chunk spans: exp(60) ~ 1e26 stays finite in f32
_TOKEN_LOG_RANGE = 20.0


def ssm_scan_ref(
    s: torch.Tensor,  # [n_seqs, d_inner, d_state] state before the tokens
    x: torch.Tensor,  # [n_seqs, T, d_inner]
    dt: torch.Tensor,  # [n_seqs, T, d_inner] (bias added, before softplus)
    A: torch.Tensor,  # [d_inner, d_state]
    B: torch.Tensor,  # [n_seqs, T, d_state]
    C: torch.Tensor,  # [n_seqs, T, d_state]
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [n_seqs, T, d_inner] and the states after each of the last `n_states` tokens
    [n_seqs, n_states, d_inner, d_state] (oldest first; the last one is the final state)."""
    T = x.shape[1]
    assert 1 <= n_states <= T, (n_states, T)
    dts = softplus(dt.float())
    # log decay of each token, <= 0; below -20 the old state's share (< 2e-9) is clamped there
    la_tok = (dts[..., None] * A.float()).clamp(min=-_TOKEN_LOG_RANGE)  # [S, T, D, N]
    ub = (dts * x.float())[..., None] * B.float()[:, :, None, :]  # [S, T, D, N]
    # Inside a chunk h[t] = exp(L[t]) * (h0 + sum_{tau <= t} exp(-L[tau]) ub[tau]), L the
    # cumulative log decay from the chunk's start: a chunk ends before its decay could pass
    # _LOG_RANGE (40 from the running total's steps, plus one token's 20), so exp(-L) is finite.
    per = (-la_tok).amax(dim=(0, 2, 3))  # [T] the strongest decay of each token
    step = torch.div(torch.cumsum(per, 0) - per, _LOG_RANGE - _TOKEN_LOG_RANGE, rounding_mode="floor")
    cuts = (torch.nonzero(step[1:] != step[:-1]).flatten() + 1).tolist()
    h = s.float()
    hs_all = []
    for c0, c1 in zip([0, *cuts], [*cuts, T], strict=True):
        la = torch.cumsum(la_tok[:, c0:c1], dim=1)  # [S, q, D, N]
        hs = torch.exp(la) * (h[:, None] + torch.cumsum(torch.exp(-la) * ub[:, c0:c1], dim=1))
        hs_all.append(hs)
        h = hs[:, -1]
    hs = torch.cat(hs_all, dim=1)  # [S, T, D, N]
    y = torch.einsum("stdn,stn->std", hs, C.float())
    return y.to(x.dtype), hs[:, T - n_states :].clone()


def ssm_scan_step_ref(
    s: torch.Tensor,  # [n_seqs, d_inner, d_state]
    x: torch.Tensor,  # [n_seqs, d_inner]
    dt: torch.Tensor,  # [n_seqs, d_inner]
    A: torch.Tensor,  # [d_inner, d_state]
    B: torch.Tensor,  # [n_seqs, d_state]
    C: torch.Tensor,  # [n_seqs, d_state]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (decode): y [n_seqs, d_inner] and the new state [n_seqs, d_inner, d_state]."""
    dts = softplus(dt.float())[:, :, None]  # [S, D, 1]
    h = torch.exp(dts * A.float()) * s.float() + dts * x.float()[:, :, None] * B.float()[:, None, :]
    return torch.einsum("sdn,sn->sd", h, C.float()).to(x.dtype), h


@jit
def _ssm_scan_kernel(
    s_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, y_ptr, out_ptr,
    T, d_inner, d_state, n_states,
    ss_s, ss_d,
    sx_s, sx_t,
    sdt_s, sdt_t,
    sa_d,
    sb_s, sb_t,
    sc_s, sc_t,
    sy_s, sy_t,
    so_s, so_k, so_d,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, block of channels): the state [BLOCK_D, d_state] stays in
    # registers while the tokens go by in order.
    seq = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < d_inner
    n_ok = offs_n < d_state
    dn_ok = d_ok[:, None] & n_ok[None, :]
    h = tl.load(s_ptr + seq * ss_s + offs_d[:, None] * ss_d + offs_n[None, :], mask=dn_ok, other=0.0)
    a = tl.load(a_ptr + offs_d[:, None] * sa_d + offs_n[None, :], mask=dn_ok, other=0.0)
    for t in range(0, T):
        x = tl.load(x_ptr + seq * sx_s + t * sx_t + offs_d, mask=d_ok, other=0.0)
        dt = tl.load(dt_ptr + seq * sdt_s + t * sdt_t + offs_d, mask=d_ok, other=0.0)
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        b = tl.load(b_ptr + seq * sb_s + t * sb_t + offs_n, mask=n_ok, other=0.0)
        c = tl.load(c_ptr + seq * sc_s + t * sc_t + offs_n, mask=n_ok, other=0.0)
        h = tl.exp(dt[:, None] * a) * h + (dt * x)[:, None] * b[None, :]
        y = tl.sum(h * c[None, :], axis=1)
        tl.store(y_ptr + seq * sy_s + t * sy_t + offs_d, y, mask=d_ok)
        k = t - (T - n_states)
        if k >= 0:
            o = out_ptr + seq * so_s + k * so_k + offs_d[:, None] * so_d + offs_n[None, :]
            tl.store(o, h, mask=dn_ok)


def ssm_scan_triton(
    s: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    n_states: int = 1,
    *,
    block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `ssm_scan_ref` (same contract, f32 tensors)."""
    assert triton is not None, "ssm_scan_triton needs triton"
    S, T, D = x.shape
    N = A.shape[1]
    assert s.shape == (S, D, N) and dt.shape == (S, T, D) and A.shape == (D, N), (s.shape, dt.shape, A.shape)
    assert B.shape == (S, T, N) and C.shape == (S, T, N), (B.shape, C.shape)
    assert 1 <= n_states <= T, (n_states, T)
    s, x, dt, A, B, C = f32_operands(s, x, dt, A, B, C)
    y = torch.empty(S, T, D, dtype=torch.float32, device=x.device)
    out = torch.empty(S, n_states, D, N, dtype=torch.float32, device=x.device)
    block_d = block_d or min(64, triton.next_power_of_2(D))
    grid = (S, triton.cdiv(D, block_d))
    _ssm_scan_kernel[grid](
        s, x, dt, A, B, C, y, out,
        T, D, N, n_states,
        s.stride(0), s.stride(1),
        x.stride(0), x.stride(1),
        dt.stride(0), dt.stride(1),
        A.stride(0),
        B.stride(0), B.stride(1),
        C.stride(0), C.stride(1),
        y.stride(0), y.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(N),
    )  # fmt: skip
    return y, out


def ssm_scan_step_triton(
    s: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `ssm_scan_step_ref`: the scan kernel over one token."""
    return step_of(ssm_scan_triton, (s, x, dt, A, B, C))


def ssm_scan(
    s: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan over a ubatch (see `ssm_scan_ref`): a single token takes the step
    form; Triton on CUDA tensors, the reference elsewhere."""
    if use_triton(s, x, dt, A, B, C):
        return ssm_scan_triton(s, x, dt, A, B, C, n_states)
    return scan_ref(ssm_scan_step_ref, ssm_scan_ref, (s, x, dt, A, B, C), n_states)
