"""wkv6: RWKV-6's linear attention with data-dependent decay (ggml's rwkv_wkv6).

Per sequence and head, with a state S [head_size (key i), head_size (value j)]:

    out_t[j] = sum_i r_t[i] * (u[i] * k_t[i] * v_t[j] + S[i, j])
    S[i, j]  = w_t[i] * S[i, j] + k_t[i] * v_t[j]

The decay is given in log space (`w_log` = log w_t <= 0; RWKV-6 computes w = exp(-exp(x)), so
w_log = -exp(x) is exact where w itself would round to 1): the chunked prompt form needs sums of
log-decays, and the step form multiplies by exp(w_log), the f32 value ggml multiplies by.

Layouts: r, k, v, w_log [n_seqs, n_tokens, n_head, head_size]; u [n_head, head_size];
state [n_seqs, n_head, head_size, head_size]. Every function leaves its inputs unchanged and
returns (out like v, states): the step form the new state [n_seqs, n_head, N, N]; the others the
states after each of the last `n_states` tokens, [n_seqs, n_states, n_head, N, N], oldest first
(the last one is the final state; the others are what a rollback of the memory restores).
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton, use_triton
from ._wkv import launch, trailing_states_ref

CHUNK = 32  # tokens per chunk of the prompt form: [L, L, head_size] decay tiles per head
W_LOG_MIN = -20.0  # the strongest per-token log-decay the chunked form uses (see there)


def wkv6_step_ref(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_log: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode form: one token per sequence (n_tokens == 1), the recurrence as written."""
    assert r.shape[1] == 1, r.shape
    r0, k0, v0, w0 = (x[:, 0].float() for x in (r, k, v, w_log))  # [B, H, N]
    kv = k0[..., :, None] * v0[..., None, :]  # [B, H, N, N]
    s = state.float()
    out = torch.einsum("bhi,bhij->bhj", r0, u.float()[None, :, :, None] * kv + s)
    s_new = torch.exp(w0)[..., :, None] * s + kv
    return out[:, None].to(v.dtype), s_new


def wkv6_chunked_ref(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_log: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt form: chunks of `chunk` tokens, each computed in matrix form.

    Within a chunk with inclusive cumulative log-decay A_t (and A_{t-1} before token t):
    out_t = (r_t * exp(A_{t-1})) S0 + sum_{s<t} [sum_i r_t[i] k_s[i] exp(A_{t-1}[i] - A_s[i])] v_s
    + (r_t . u k_t) v_t. Every exponent is a sum of log-decays, so <= 0: nothing overflows.
    """
    T = r.shape[1]
    rt, kt, vt = (x.float().transpose(1, 2) for x in (r, k, v))  # [B, H, T, N]
    # A decay stronger than e^-20 per token leaves < 2e-9 of the state, as good as 0 next to the
    # new k v; bounding it keeps the chunk's cumulative sums small, so their differences (the
    # decay between two tokens) keep f32 precision after a token that decays a channel to ~0.
    wt = w_log.float().clamp(min=W_LOG_MIN).transpose(1, 2)
    s = state.float()
    uf = u.float()
    outs = []
    for c0 in range(0, T, chunk):
        rc, kc, vc, wc = (x[:, :, c0 : c0 + chunk] for x in (rt, kt, vt, wt))
        L = rc.shape[2]
        a = torch.cumsum(wc, dim=2)  # [B, H, L, N] inclusive
        a_ex = a - wc  # decay before token t
        strict = torch.ones(L, L, dtype=torch.bool, device=r.device).tril(-1)  # s < t
        diff = (a_ex[:, :, :, None, :] - a[:, :, None, :, :]).masked_fill(~strict[:, :, None], float("-inf"))
        p = torch.einsum("bhti,bhtsi,bhsi->bhts", rc, torch.exp(diff), kc)  # [B, H, L, L]
        p = p + torch.diag_embed((rc * uf[None, :, None, :] * kc).sum(-1))  # the bonus on token t itself
        outs.append((rc * torch.exp(a_ex)) @ s + p @ vc)  # [B, H, L, N]
        a_last = a[:, :, -1:, :]  # [B, H, 1, N]
        s = torch.exp(a_last).transpose(-1, -2) * s + (kc * torch.exp(a_last - a)).transpose(-1, -2) @ vc
    out = torch.cat(outs, dim=2).transpose(1, 2)  # [B, T, H, N]
    return out.to(v.dtype), s


def wkv6_ref(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_log: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WKV-6 in torch: the chunked form up to the first of the trailing `n_states` tokens, then
    the step form for the others (a single token takes the step form only)."""
    return trailing_states_ref(wkv6_step_ref, wkv6_chunked_ref, (r, k, v, w_log), (u,), state, n_states)


@jit
def _wkv6_kernel(
    r_ptr, k_ptr, v_ptr, w_ptr,  # [B, T, H, N] contiguous
    u_ptr,  # [H, N]
    s_ptr,  # [B, H, N, N] state in
    o_ptr,  # [B, T, H, N]
    so_ptr,  # [B, n_states, H, N, N] states out
    T, H, N, n_states,
    BK: tl.constexpr,
    BV: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, head, block of value columns): the state tile [N keys, BV
    # values] stays in registers across all tokens, so the prompt and decode forms are one kernel.
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mk = offs_k < N
    mv = offs_v < N
    m2 = mk[:, None] & mv[None, :]
    s_off = bh.to(tl.int64) * N * N + offs_k[:, None] * N + offs_v[None, :]
    s = tl.load(s_ptr + s_off, mask=m2, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + h * N + offs_k, mask=mk, other=0.0).to(tl.float32)
    for t in range(T):
        base = ((b.to(tl.int64) * T + t) * H + h) * N
        r = tl.load(r_ptr + base + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + base + offs_k, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + base + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + base + offs_v, mask=mv, other=0.0).to(tl.float32)
        kv = k[:, None] * v[None, :]
        o = tl.sum((u[:, None] * kv + s) * r[:, None], axis=0)
        tl.store(o_ptr + base + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)
        s = s * tl.exp(w)[:, None] + kv
        j = t - (T - n_states)
        if j >= 0:  # one of the trailing states
            so_off = ((b.to(tl.int64) * n_states + j) * H + h) * N * N
            tl.store(so_ptr + so_off + offs_k[:, None] * N + offs_v[None, :], s, mask=m2)


def wkv6_triton(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_log: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `wkv6_ref` (same contract; the states come back in f32)."""
    assert triton is not None, "wkv6_triton needs triton"
    assert u.shape == (r.shape[2], r.shape[3]), (r.shape, u.shape)
    return launch(_wkv6_kernel, (r, k, v, w_log), (u,), state, n_states, v.dtype, max_bv=64)


def wkv6(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w_log: torch.Tensor,
    u: torch.Tensor,
    state: torch.Tensor,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WKV-6 (see the module docstring): Triton on CUDA tensors, the reference elsewhere."""
    if use_triton(r, k, v, w_log, u, state):
        return wkv6_triton(r, k, v, w_log, u, state, n_states)
    return wkv6_ref(r, k, v, w_log, u, state, n_states)
