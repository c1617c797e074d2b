"""Mamba-2 scan (ggml's ssm_scan with a scalar A per head; the SSD of "Transformers are SSMs"):
for each sequence, head h (of group g = h // (n_head / n_group)), head channel p and state j,

    d = softplus(dt[t, h])
    h[t, h, p, j] = exp(d * A[h]) * h[t-1, h, p, j] + d * x[t, h, p] * B[t, g, j]
    y[t, h, p]    = sum_j h[t, h, p, j] * C[t, g, j]

Prompts run as chunked SSD: inside a chunk, y is a masked "attention" (C B^T weighted by the
decay between the two tokens) over the chunk, plus the carried state read through C; the
state is carried from chunk to chunk. All decay exponents are <= 0.
"""

from __future__ import annotations

import torch

from ._scan import f32_operands, scan_ref, softplus, step_of
from ._triton import jit, tl, triton, use_triton

CHUNK = 64


def _heads(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """[..., n_group, N] -> [..., n_head, N]: each group serves n_head / n_group consecutive heads."""
    return t.repeat_interleave(n_head // t.shape[-2], dim=-2)


def ssd_ref(
    s: torch.Tensor,  # [n_seqs, n_head, head_dim, d_state] state before the tokens
    x: torch.Tensor,  # [n_seqs, T, n_head, head_dim]
    dt: torch.Tensor,  # [n_seqs, T, n_head] (bias added, before softplus)
    A: torch.Tensor,  # [n_head]
    B: torch.Tensor,  # [n_seqs, T, n_group, d_state]
    C: torch.Tensor,  # [n_seqs, T, n_group, d_state]
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [n_seqs, T, n_head, head_dim] and the states after each of the last `n_states`
    tokens [n_seqs, n_states, n_head, head_dim, d_state] (oldest first)."""
    _, T, H, _ = x.shape
    assert 1 <= n_states <= T, (n_states, T)
    dts = softplus(dt.float())  # [S, T, H]
    ux = dts[..., None] * x.float()  # [S, T, H, P]
    Bh, Ch = _heads(B.float(), H), _heads(C.float(), H)  # [S, T, H, N]
    h = s.float()
    ys, trail = [], []
    for c0 in range(0, T, CHUNK):
        c1 = min(T, c0 + CHUNK)
        q = c1 - c0
        la = torch.cumsum(dts[:, c0:c1] * A.float(), dim=1)  # [S, q, H]
        seg = la[:, :, None] - la[:, None, :]  # [S, t, tau, H]
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
        w = torch.exp(seg.masked_fill(~causal, float("-inf")))
        b, c, u = Bh[:, c0:c1], Ch[:, c0:c1], ux[:, c0:c1]
        cb = torch.einsum("sthn,sqhn->stqh", c, b)
        y = torch.einsum("stqh,sqhp->sthp", w * cb, u)
        y = y + torch.einsum("sthn,shpn->sthp", c, h) * torch.exp(la)[..., None]
        ys.append(y)
        first = max(0, T - n_states - c0) if c1 > T - n_states else q - 1
        sel = torch.arange(first, q, device=x.device)  # tokens whose state is needed
        hs = torch.einsum("skqh,sqhp,sqhn->skhpn", w[:, sel], u, b)
        hs = hs + torch.exp(la[:, sel])[..., None, None] * h[:, None]  # [S, k, H, P, N]
        if c1 > T - n_states:
            trail.append(hs)
        h = hs[:, -1]
    return torch.cat(ys, dim=1).to(x.dtype), torch.cat(trail, dim=1)


def ssd_step_ref(
    s: torch.Tensor,  # [n_seqs, n_head, head_dim, d_state]
    x: torch.Tensor,  # [n_seqs, n_head, head_dim]
    dt: torch.Tensor,  # [n_seqs, n_head]
    A: torch.Tensor,  # [n_head]
    B: torch.Tensor,  # [n_seqs, n_group, d_state]
    C: torch.Tensor,  # [n_seqs, n_group, d_state]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (decode): y [n_seqs, n_head, head_dim] and the new state."""
    H = x.shape[1]
    dts = softplus(dt.float())  # [S, H]
    decay = torch.exp(dts * A.float())[..., None, None]  # [S, H, 1, 1]
    Bh, Ch = _heads(B.float(), H), _heads(C.float(), H)  # [S, H, N]
    h = decay * s.float() + (dts[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    return torch.einsum("shpn,shn->shp", h, Ch).to(x.dtype), h


@jit
def _ssd_kernel(
    s_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, y_ptr, out_ptr,
    T, n_head, heads_per_group, head_dim, d_state, n_states,
    ss_s, ss_h, ss_p,
    sx_s, sx_t, sx_h,
    sdt_s, sdt_t,
    sb_s, sb_t, sb_g,
    sc_s, sc_t, sc_g,
    sy_s, sy_t, sy_h,
    so_s, so_k, so_h, so_p,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, head, block of head channels), tokens in order: the state
    # [BLOCK_P, d_state] stays in registers; the decay is one scalar per token.
    pid = tl.program_id(0)
    seq = (pid // n_head).to(tl.int64)
    head = pid % n_head
    g = head // heads_per_group
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_ok = offs_p < head_dim
    n_ok = offs_n < d_state
    pn_ok = p_ok[:, None] & n_ok[None, :]
    h = tl.load(
        s_ptr + seq * ss_s + head * ss_h + offs_p[:, None] * ss_p + offs_n[None, :], mask=pn_ok, other=0.0
    )
    a = tl.load(a_ptr + head)
    for t in range(0, T):
        dt = tl.load(dt_ptr + seq * sdt_s + t * sdt_t + head)
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        x = tl.load(x_ptr + seq * sx_s + t * sx_t + head * sx_h + offs_p, mask=p_ok, other=0.0)
        b = tl.load(b_ptr + seq * sb_s + t * sb_t + g * sb_g + offs_n, mask=n_ok, other=0.0)
        c = tl.load(c_ptr + seq * sc_s + t * sc_t + g * sc_g + offs_n, mask=n_ok, other=0.0)
        h = tl.exp(dt * a) * h + (dt * x)[:, None] * b[None, :]
        y = tl.sum(h * c[None, :], axis=1)
        tl.store(y_ptr + seq * sy_s + t * sy_t + head * sy_h + offs_p, y, mask=p_ok)
        k = t - (T - n_states)
        if k >= 0:
            o = out_ptr + seq * so_s + k * so_k + head * so_h + offs_p[:, None] * so_p + offs_n[None, :]
            tl.store(o, h, mask=pn_ok)


def ssd_triton(
    s: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    n_states: int = 1,
    *,
    block_p: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `ssd_ref` (same contract, f32 tensors)."""
    assert triton is not None, "ssd_triton needs triton"
    S, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    assert s.shape == (S, H, P, N) and dt.shape == (S, T, H) and A.shape == (H,), (s.shape, dt.shape, A.shape)
    assert B.shape == (S, T, G, N) and C.shape == (S, T, G, N) and H % G == 0, (B.shape, C.shape, H)
    assert 1 <= n_states <= T, (n_states, T)
    s, x, dt, A, B, C = f32_operands(s, x, dt, A, B, C)
    y = torch.empty(S, T, H, P, dtype=torch.float32, device=x.device)
    out = torch.empty(S, n_states, H, P, N, dtype=torch.float32, device=x.device)
    block_p = block_p or min(64, triton.next_power_of_2(P))
    grid = (S * H, triton.cdiv(P, block_p))
    _ssd_kernel[grid](
        s, x, dt, A, B, C, y, out,
        T, H, H // G, P, N, n_states,
        s.stride(0), s.stride(1), s.stride(2),
        x.stride(0), x.stride(1), x.stride(2),
        dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(N),
    )  # fmt: skip
    return y, out


def ssd_step_triton(
    s: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `ssd_step_ref`: the scan kernel over one token."""
    return step_of(ssd_triton, (s, x, dt, A, B, C))


def ssd(
    s: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 scan over a ubatch (see `ssd_ref`): a single token takes the step form;
    Triton on CUDA tensors, the reference elsewhere."""
    if use_triton(s, x, dt, A, B, C):
        return ssd_triton(s, x, dt, A, B, C, n_states)
    return scan_ref(ssd_step_ref, ssd_ref, (s, x, dt, A, B, C), n_states)
