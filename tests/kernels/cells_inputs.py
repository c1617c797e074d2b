"""Random cell metadata for the attention tests: cells as a KV cache holds them.

Cells carry a position (or -1: empty) and the set of sequences that share them (a bitset, as
after seq_cp in a unified stream); queries carry their position and sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.kernels.visibility import Cells


@dataclass(frozen=True)
class CellCase:
    name: str
    n_stream: int
    n_q: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_kv: int
    n_seq: int = 1  # sequences per stream (> 1: a unified stream)
    swa: str = "none"
    n_swa: int = 0
    causal: bool = True
    ordered: bool = False  # cells in position order (a fresh cache), else shuffled
    n_split: int | None = None
    block_n: int | None = None


def make_cells(c: CellCase, seed: int) -> Cells:
    g = torch.Generator().manual_seed(seed)
    S, n_kv = c.n_stream, c.n_kv
    seq = torch.randint(0, c.n_seq, (S, n_kv), generator=g)
    bits = torch.ones(S, n_kv, dtype=torch.int64) << seq
    shared = torch.rand(S, n_kv, generator=g) < 0.2  # a cell some other sequence also holds
    other = torch.randint(0, c.n_seq, (S, n_kv), generator=g)
    bits = torch.where(shared, bits | (torch.ones_like(bits) << other), bits)
    if c.ordered:
        pos = torch.arange(n_kv).expand(S, n_kv).clone()
    else:
        pos = torch.stack([torch.randperm(n_kv, generator=g) for _ in range(S)])
    empty = torch.rand(S, n_kv, generator=g) < 0.1
    pos, bits = pos.masked_fill(empty, -1), bits.masked_fill(empty, 0)
    # queries: the newest positions (a prompt's run, or one token), each of some sequence
    q_pos = torch.arange(n_kv - c.n_q, n_kv).clamp(min=0).expand(S, c.n_q).clone()
    q_seq = torch.randint(0, c.n_seq, (S, c.n_q), generator=g)
    return Cells(pos, bits, q_pos, q_seq, c.swa, c.n_swa, c.causal)


def make_qkv(c: CellCase, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    q = torch.randn(c.n_stream, c.n_q, c.n_head, c.head_dim, generator=g)
    k = torch.randn(c.n_stream, c.n_kv, c.n_head_kv, c.head_dim, generator=g)
    v = torch.randn(c.n_stream, c.n_kv, c.n_head_kv, c.head_dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)
