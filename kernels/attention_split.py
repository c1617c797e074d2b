"""Split-KV attention (flash-decoding): the launch policy, the reduction that merges the
splits' partial softmax states, and the row layout and output store both attention kernels
share (kernels/attention_triton.py launches them)."""

from __future__ import annotations

from ._triton import jit, tl, triton


@jit
def _rows(pid_rows, pid_sh, n_q, n_head_kv, group, BLOCK_M: tl.constexpr):
    # A program owns one (stream, kv head) and BLOCK_M rows of (query, head in the group):
    # row r is query r // group with head hkv * group + r % group. Packing the group's heads
    # into rows reads each K/V tile once for all of them and fills the tile at decode.
    s = (pid_sh // n_head_kv).to(tl.int64)
    hkv = pid_sh % n_head_kv
    rows = pid_rows * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    qi = rows // group
    return s, hkv, rows, qi, hkv * group + rows % group, qi < n_q


@jit
def _store_out(o_ptr, s, qi, head, so_s, so_m, so_h, acc, l_i, row_ok, offs_dv, dv_ok):
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row that saw no key stays 0
    o_ptrs = o_ptr + s * so_s + qi[:, None] * so_m + head[:, None] * so_h + offs_dv[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


@jit
def _attention_reduce_kernel(
    m_ptr, l_ptr, acc_ptr,  # the partials of _attention_kernel's splits
    o_ptr,  # [S, n_q, H, Dv]
    so_s, so_m, so_h,
    n_q, n_head_kv, group, head_dim_v, n_split,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    # Merges the splits of one (stream, kv head) and BLOCK_M rows as the kernel merges tiles:
    # rescale what was summed so far and the split to their common max.
    pid_sh = tl.program_id(1)
    s, _hkv, rows, qi, head, row_ok = _rows(tl.program_id(0), pid_sh, n_q, n_head_kv, group, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < head_dim_v
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for split in range(0, n_split):
        part = (split * tl.num_programs(1) + pid_sh).to(tl.int64) * n_q * group + rows
        m_j = tl.load(m_ptr + part, mask=row_ok, other=float("-inf"))
        l_j = tl.load(l_ptr + part, mask=row_ok, other=0.0)
        acc_ptrs = acc_ptr + part[:, None] * head_dim_v + offs_dv[None, :]
        acc_j = tl.load(acc_ptrs, mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
        m_new = tl.maximum(m_i, m_j)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no split saw a key yet
        alpha = tl.math.exp2(m_i - m_safe)
        beta = tl.math.exp2(m_j - m_safe)
        l_i = l_i * alpha + l_j * beta
        acc = acc * alpha[:, None] + acc_j * beta[:, None]
        m_i = m_new
    _store_out(o_ptr, s, qi, head, so_s, so_m, so_h, acc, l_i, row_ok, offs_dv, dv_ok)


# Split-KV (flash-decoding) policy: when one row block per (stream, KV head) leaves the GPU
# idle, split the keys so that every SM gets about two programs, but keep each split at least
# _SPLIT_MIN_KV keys long, below which its partials and the reduction outweigh the gain.
_SPLIT_MIN_KV = 256
_NOMINAL_SMS = 132  # an H100's, for CPU tensors: the interpreter takes a GPU's decisions


def _n_split(n_row_blocks: int, n_stream_heads: int, n_kv: int, n_sm: int) -> int:
    if n_row_blocks > 1:  # prompts: their rows fill the grid
        return 1
    return max(1, min(n_kv // _SPLIT_MIN_KV, triton.cdiv(2 * n_sm, n_stream_heads)))
