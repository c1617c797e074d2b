"""Attention inputs for the kernel tests: cases, masks built from cell metadata, tolerances.

Masks are built from cell metadata the way the KV cache builds them: a cell is visible to a
query when it is used, belongs to the query's sequence, is not in its future and (for SWA)
lies inside the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def build_mask(
    cell_pos: torch.Tensor,  # [S, n_kv] int, -1 = empty cell
    cell_seq: torch.Tensor,  # [S, n_kv] int
    q_pos: torch.Tensor,  # [S, n_q] int
    q_seq: torch.Tensor,  # [S, n_q] int
    n_swa: int = 0,
) -> torch.Tensor:  # [S, n_q, n_kv] float32, 0 or -inf
    cp, cs = cell_pos[:, None, :], cell_seq[:, None, :]  # [S, 1, n_kv]
    qp, qs = q_pos[:, :, None], q_seq[:, :, None]  # [S, n_q, 1]
    seen = (cp >= 0) & (cs == qs) & (cp <= qp)
    if n_swa:
        seen &= qp - cp < n_swa
    return torch.zeros(seen.shape).masked_fill(~seen, NEG_INF)


@dataclass(frozen=True)
class Case:
    name: str
    n_stream: int
    n_q: int
    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_kv: int
    layout: str  # "causal" | "shared" (two sequences in one stream) | "swa" | "masked_row"
    block_m: int | None = None
    block_n: int | None = None
    strided: bool = False  # q from a fused qkv row, k/v a slice of a larger cache


CASES = [
    # decode: one query per stream, many streams
    Case("decode", 4, 1, 4, 4, 64, 64, 50, "causal"),
    Case("decode_gqa3_swa", 3, 1, 6, 2, 16, 16, 40, "swa"),
    # prompt: several queries, n_kv not a multiple of the block
    Case("prompt_gqa2", 2, 5, 4, 2, 32, 32, 37, "causal", 16, 16),
    Case("prompt_rows_gt_block", 1, 24, 2, 1, 32, 32, 45, "shared", 16, 16, strided=True),
    Case("prompt_swa_skips_tiles", 2, 20, 2, 2, 64, 64, 70, "swa", 16, 16),
    Case("masked_row_gqa3_dv", 2, 3, 3, 1, 16, 32, 20, "masked_row"),
    Case("head_dim_48", 2, 3, 4, 4, 48, 48, 33, "causal"),  # not a power of two: masked lanes
]


def make_inputs(c: Case, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    S, n_kv = c.n_stream, c.n_kv
    # cells hold a run of positions per stream with some empty cells, shuffled (a cache is not
    # in position order) except for SWA, whose ordered cells let whole tiles fall outside the
    # window; queries are the newest positions of their sequence.
    order = [torch.arange(n_kv) if c.layout == "swa" else torch.randperm(n_kv, generator=g) for _ in range(S)]
    cell_pos = torch.stack(order)  # [S, n_kv]
    cell_seq = torch.zeros(S, n_kv, dtype=torch.long)
    empty = torch.rand(S, n_kv, generator=g) < 0.15
    cell_pos = cell_pos.masked_fill(empty, -1)
    top = max(n_kv - 1, c.n_q)
    q_pos = torch.arange(top - c.n_q + 1, top + 1).expand(S, c.n_q).clone()  # [S, n_q]
    q_seq = torch.zeros(S, c.n_q, dtype=torch.long)
    if c.layout == "shared":  # odd cells and odd queries belong to sequence 1
        cell_seq[:, 1::2] = 1
        q_seq[:, 1::2] = 1
    if c.layout == "masked_row":
        q_seq[-1, -1] = 7  # a sequence with no cell in the stream: its row sees nothing
    mask = build_mask(cell_pos, cell_seq, q_pos, q_seq, n_swa=8 if c.layout == "swa" else 0)
    if c.layout == "masked_row":
        mask[0, 0] = NEG_INF

    q = torch.randn(S, c.n_q, c.n_head, c.head_dim, generator=g)  # [S, n_q, H, D]
    k = torch.randn(S, n_kv, c.n_head_kv, c.head_dim, generator=g)  # [S, n_kv, Hkv, D]
    v = torch.randn(S, n_kv, c.n_head_kv, c.head_dim_v, generator=g)  # [S, n_kv, Hkv, Dv]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if c.strided:
        qkv = torch.zeros(S, c.n_q, c.n_head, 3 * c.head_dim, dtype=dtype)
        qkv[..., : c.head_dim] = q
        q = qkv[..., : c.head_dim]  # [S, n_q, H, D], head stride 3 * D
        k_cache = torch.zeros(S, n_kv + 11, c.n_head_kv, c.head_dim, dtype=dtype)
        v_cache = torch.zeros(S, n_kv + 11, c.n_head_kv, c.head_dim_v, dtype=dtype)
        k_cache[:, :n_kv], v_cache[:, :n_kv] = k, v
        k, v = k_cache[:, :n_kv], v_cache[:, :n_kv]  # views of the first n_kv cells
        mask = mask.half()  # llama.cpp keeps the KQ mask in f16 for flash attention
    return q, k, v, mask


TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),  # exact fp32 dots: only summation order differs
    torch.float16: dict(atol=2e-3, rtol=1e-2),  # p is rounded to fp16 before the PV dot
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),  # upcast to fp32; output rounding only
}


class Pick:
    """Random choices from one seeded generator: random shapes that a seed reproduces."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, options: list):
        return options[self.int(0, len(options))]

    def int(self, lo: int, hi: int) -> int:  # in [lo, hi)
        return int(torch.randint(lo, hi, (1,), generator=self.g))


def random_case(
    pick: Pick, name: str, *, n_q: list[int], n_kv: tuple[int, int], ratio: list[int], block_n: list
) -> Case:
    """A random case of any layout, with GQA ratios from `ratio` and n_kv in [n_kv[0], n_kv[1])."""
    n_head_kv, group, head_dim = pick([1, 2]), pick(ratio), pick([16, 32, 64])
    return Case(
        name,
        n_stream=pick([1, 2, 3]),
        n_q=pick(n_q),
        n_head=n_head_kv * group,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim,
        n_kv=pick.int(*n_kv),
        layout=pick(["causal", "shared", "swa", "masked_row"]),
        block_m=pick([16, 32, None]),
        block_n=pick(block_n),
    )
