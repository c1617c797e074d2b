"""Short causal depthwise convolution with a carried state (ggml_ssm_conv; LFM2's short conv,
the convolution in front of Mamba's scan): for each sequence, token t and channel c,

    y[t, c] = sum_k xp[t + k, c] * w[c, k] (+ b[c]),   xp = [state; x] (state: the last
                                                        L - 1 inputs before the ubatch)

and the new state is the last L - 1 rows of xp. With `n_states > 1` the states after each of
the ubatch's trailing tokens are returned too (rollback snapshots).
"""

from __future__ import annotations

import torch

from ._triton import jit, tl, triton, use_triton


def short_conv_ref(
    state: torch.Tensor,  # [n_seqs, L - 1, C] the inputs before the ubatch, oldest first
    x: torch.Tensor,  # [n_seqs, T, C]
    w: torch.Tensor,  # [C, L]
    b: torch.Tensor | None = None,  # [C]
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y [n_seqs, T, C] and the states after each of the last `n_states` tokens
    [n_seqs, n_states, L - 1, C] (oldest first)."""
    L, T = w.shape[1], x.shape[1]
    assert state.shape[1] == L - 1 and 1 <= n_states <= T, (state.shape, w.shape, n_states, T)
    xp = torch.cat([state.to(x.dtype), x], dim=1)  # [S, L - 1 + T, C]
    y = torch.einsum("stck,ck->stc", xp.unfold(1, L, 1), w)  # unfold: [S, T, C, L]
    if b is not None:
        y = y + b
    states = xp.unfold(1, L - 1, 1)[:, T + 1 - n_states :]  # [S, n_states, C, L - 1]
    return y, states.transpose(2, 3)


@jit
def _short_conv_kernel(
    s_ptr, x_ptr, w_ptr, b_ptr, y_ptr, out_ptr,
    T, C, L, n_states,
    ss_s, ss_l,
    sx_s, sx_t,
    sw_c,
    sy_s, sy_t,
    so_s, so_k, so_l,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, block of channels). Row i of xp = [state; x] is state row i
    # for i < L - 1, else input i - (L - 1): each read picks its source with two masked loads.
    seq = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    s_base = s_ptr + seq * ss_s + offs_c
    x_base = x_ptr + seq * sx_s + offs_c
    zero = tl.zeros([BLOCK_C], dtype=tl.int64)
    for t in range(0, T):
        if HAS_BIAS:
            acc = tl.load(b_ptr + offs_c, mask=c_ok, other=0.0)
        else:
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for k in range(0, L):
            i = zero + t + k  # row of xp, per channel lane (masks must be tensors)
            v = tl.load(s_base + i * ss_l, mask=c_ok & (i < L - 1), other=0.0) + tl.load(
                x_base + (i - (L - 1)) * sx_t, mask=c_ok & (i >= L - 1), other=0.0
            )
            acc += v * tl.load(w_ptr + offs_c * sw_c + k, mask=c_ok, other=0.0)
        tl.store(y_ptr + seq * sy_s + t * sy_t + offs_c, acc, mask=c_ok)
        j = t - (T - n_states)
        if j >= 0:  # the state after token t: rows t + 1 .. t + L - 1 of xp
            for r in range(0, L - 1):
                i = zero + t + 1 + r
                v = tl.load(s_base + i * ss_l, mask=c_ok & (i < L - 1), other=0.0) + tl.load(
                    x_base + (i - (L - 1)) * sx_t, mask=c_ok & (i >= L - 1), other=0.0
                )
                tl.store(out_ptr + seq * so_s + j * so_k + r * so_l + offs_c, v, mask=c_ok)


def short_conv_triton(
    state: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    n_states: int = 1,
    *,
    block_c: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `short_conv_ref` (same contract, f32 tensors)."""
    assert triton is not None, "short_conv_triton needs triton"
    S, T, C = x.shape
    L = w.shape[1]
    assert w.shape == (C, L) and L >= 2 and state.shape == (S, L - 1, C), (w.shape, state.shape)
    assert b is None or b.shape == (C,), b.shape
    assert 1 <= n_states <= T, (n_states, T)
    state, x, w = (t.float().contiguous() for t in (state, x, w))
    bias = b.float().contiguous() if b is not None else w  # unread without HAS_BIAS
    y = torch.empty(S, T, C, dtype=torch.float32, device=x.device)
    out = torch.empty(S, n_states, L - 1, C, dtype=torch.float32, device=x.device)
    block_c = block_c or min(128, triton.next_power_of_2(C))
    grid = (S, triton.cdiv(C, block_c))
    _short_conv_kernel[grid](
        state, x, w, bias, y, out,
        T, C, L, n_states,
        state.stride(0), state.stride(1),
        x.stride(0), x.stride(1),
        w.stride(0),
        y.stride(0), y.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        HAS_BIAS=b is not None, BLOCK_C=block_c,
    )  # fmt: skip
    return y, out


def short_conv(
    state: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    n_states: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The short convolution over a ubatch (see `short_conv_ref`): Triton on CUDA tensors, the
    reference elsewhere."""
    if use_triton(state, x, w, *([] if b is None else [b])):
        return short_conv_triton(state, x, w, b, n_states)
    return short_conv_ref(state, x, w, b, n_states)
