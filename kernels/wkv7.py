"""wkv7: RWKV-7's generalised delta rule (ggml's rwkv_wkv7).

Per sequence and head, with a state S [head_size (value i), head_size (key j)]:

    sa[i]    = sum_j a_t[j] * S[i, j]
    S[i, j]  = S[i, j] * w_t[j] + v_t[i] * k_t[j] + sa[i] * b_t[j]
    out_t[i] = sum_j S[i, j] * r_t[j]

i.e. S_t = S_{t-1} (diag(w_t) + a_t b_t^T) + v_t k_t^T and out_t = S_t r_t. RWKV-7 passes
a = -kk and b = kk * iclr. The decay is given in log space (`w_log` = log w_t <= 0; RWKV-7's
w = exp(-0.606531 * sigmoid(x)), so w_log = -0.606531 * sigmoid(x)).

Layouts: r, w_log, k, v, a, b [n_seqs, n_tokens, n_head, head_size]; state [n_seqs, n_head,
head_size, head_size]. Every function leaves its inputs unchanged and returns (out like v,
states): the step form the new state [n_seqs, n_head, N, N]; the others the states after each
of the last `n_states` tokens, [n_seqs, n_states, n_head, N, N], oldest first (the last one is
the final state; the others are what a rollback of the memory restores).
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton, use_triton
from ._wkv import launch, trailing_states_ref

CHUNK = 16  # tokens per chunk of the prompt form (each chunk solves an L x L triangular system)


def wkv7_step_ref(
    r: torch.Tensor,
    w_log: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode form: one token per sequence (n_tokens == 1), the recurrence as written."""
    assert r.shape[1] == 1, r.shape
    r0, w0, k0, v0, a0, b0 = (x[:, 0].float() for x in (r, w_log, k, v, a, b))  # [B, H, N]
    s = state.float()
    sa = (s @ a0[..., :, None])[..., 0]  # [B, H, N] over values
    s_new = (
        s * torch.exp(w0)[..., None, :]
        + v0[..., :, None] * k0[..., None, :]
        + sa[..., :, None] * b0[..., None, :]
    )
    out = (s_new @ r0[..., :, None])[..., 0]
    return out[:, None].to(v.dtype), s_new


def wkv7_chunked_ref(
    r: torch.Tensor,
    w_log: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt form: chunks of `chunk` tokens, each in matrix form.

    With G_t the inclusive cumulative log-decay of the chunk and D(t, s) = exp(G_t - G_s), the
    state inside a chunk is S_t = S0 diag(e^G_t) + sum_{s<=t} v_s (k_s D(t,s))^T + z_s (b_s D(t,s))^T,
    where z_t = S_{t-1} a_t (the "sa" of token t). Those z solve one unit lower-triangular system
    (I - C) Z = (a e^{G_{t-1}}) S0^T + E V, with C[t,s] = a_t.(b_s D(t-1,s)) and
    E[t,s] = a_t.(k_s D(t-1,s)) for s < t. Every exponent is <= 0: nothing overflows.
    """
    T = r.shape[1]
    rt, wt, kt, vt, at, bt = (x.float().transpose(1, 2) for x in (r, w_log, k, v, a, b))  # [B, H, T, N]
    s = state.float()  # [B, H, N(value), N(key)]
    outs = []
    for c0 in range(0, T, chunk):
        rc, wc, kc, vc, ac, bc = (x[:, :, c0 : c0 + chunk] for x in (rt, wt, kt, vt, at, bt))
        L = rc.shape[2]
        g = torch.cumsum(wc, dim=2)  # [B, H, L, N] inclusive
        g_ex = g - wc
        tri = torch.ones(L, L, dtype=torch.bool, device=r.device)
        strict, lower = tri.tril(-1)[:, :, None], tri.tril()[:, :, None]
        d_ex = torch.exp((g_ex[:, :, :, None, :] - g[:, :, None, :, :]).masked_fill(~strict, float("-inf")))
        d_in = torch.exp((g[:, :, :, None, :] - g[:, :, None, :, :]).masked_fill(~lower, float("-inf")))
        c = (ac[:, :, :, None, :] * d_ex * bc[:, :, None, :, :]).sum(-1)  # [B, H, L, L]
        e = (ac[:, :, :, None, :] * d_ex * kc[:, :, None, :, :]).sum(-1)
        rhs = (ac * torch.exp(g_ex)) @ s.transpose(-1, -2) + e @ vc  # [B, H, L, N(value)]
        z = torch.linalg.solve_triangular(-c, rhs, upper=False, unitriangular=True)  # (I - C) z = rhs
        rk = (rc[:, :, :, None, :] * d_in * kc[:, :, None, :, :]).sum(-1)  # [B, H, L, L]
        rb = (rc[:, :, :, None, :] * d_in * bc[:, :, None, :, :]).sum(-1)
        outs.append((rc * torch.exp(g)) @ s.transpose(-1, -2) + rk @ vc + rb @ z)
        g_last = g[:, :, -1:, :]  # [B, H, 1, N]
        tail = torch.exp(g_last - g)  # [B, H, L, N]
        s = s * torch.exp(g_last) + vc.transpose(-1, -2) @ (kc * tail) + z.transpose(-1, -2) @ (bc * tail)
    out = torch.cat(outs, dim=2).transpose(1, 2)  # [B, T, H, N]
    return out.to(v.dtype), s


def wkv7_ref(
    r: torch.Tensor,
    w_log: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WKV-7 in torch: the chunked form up to the first of the trailing `n_states` tokens, then
    the step form for the others (a single token takes the step form only)."""
    return trailing_states_ref(wkv7_step_ref, wkv7_chunked_ref, (r, w_log, k, v, a, b), (), state, n_states)


@jit
def _wkv7_kernel(
    r_ptr, w_ptr, k_ptr, v_ptr, a_ptr, b_ptr,  # [B, T, H, N] contiguous
    s_ptr,  # [B, H, N, N] state in
    o_ptr,  # [B, T, H, N]
    so_ptr,  # [B, n_states, H, N, N] states out
    T, H, N, n_states,
    BK: tl.constexpr,
    BV: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, head, block of value rows): rows of S evolve independently
    # (sa is a per-row dot product), so the [BV, N] tile stays in registers across all tokens.
    bh = tl.program_id(0)
    bi = bh // H
    h = bh % H
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mk = offs_k < N
    mv = offs_v < N
    m2 = mv[:, None] & mk[None, :]
    s_off = bh.to(tl.int64) * N * N + offs_v[:, None] * N + offs_k[None, :]
    s = tl.load(s_ptr + s_off, mask=m2, other=0.0).to(tl.float32)
    for t in range(T):
        base = ((bi.to(tl.int64) * T + t) * H + h) * N
        r = tl.load(r_ptr + base + offs_k, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + base + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + base + offs_k, mask=mk, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + base + offs_k, mask=mk, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + base + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + base + offs_v, mask=mv, other=0.0).to(tl.float32)
        sa = tl.sum(s * a[None, :], axis=1)  # [BV]
        s = s * tl.exp(w)[None, :] + v[:, None] * k[None, :] + sa[:, None] * b[None, :]
        o = tl.sum(s * r[None, :], axis=1)
        tl.store(o_ptr + base + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)
        j = t - (T - n_states)
        if j >= 0:  # one of the trailing states
            so_off = ((bi.to(tl.int64) * n_states + j) * H + h) * N * N
            tl.store(so_ptr + so_off + offs_v[:, None] * N + offs_k[None, :], s, mask=m2)


def wkv7_triton(
    r: torch.Tensor,
    w_log: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `wkv7_ref` (same contract; the states come back in f32)."""
    assert triton is not None, "wkv7_triton needs triton"
    return launch(_wkv7_kernel, (r, w_log, k, v, a, b), (), state, n_states, v.dtype, max_bv=32)


def wkv7(
    r: torch.Tensor,
    w_log: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    state: torch.Tensor,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WKV-7 (see the module docstring): Triton on CUDA tensors, the reference elsewhere."""
    if use_triton(r, w_log, k, v, a, b, state):
        return wkv7_triton(r, w_log, k, v, a, b, state, n_states)
    return wkv7_ref(r, w_log, k, v, a, b, state, n_states)
