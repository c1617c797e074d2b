"""Which cached keys a query sees, from cell metadata (llama.cpp's KQ mask, before it is a mask).

A cell is visible to a query when it is used (position >= 0), holds the query's sequence, is
not in the query's future (causal) and, with a sliding window, lies inside the window. The
dense float mask of `visibility_mask` is the specification; the attention kernel evaluates
`_visible` per tile instead of reading such a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import jit, tl

# sliding-window kinds (llama_swa_type): the kernel takes their index as a constexpr
SWA_KINDS: tuple[str, ...] = ("none", "standard", "chunked", "symmetric")


@dataclass(frozen=True)
class Cells:
    """What decides visibility in each stream: its cells and the queries attending to them."""

    pos: torch.Tensor  # [n_stream, n_kv] int64: each cell's position, -1 for an empty cell
    seq: torch.Tensor  # [n_stream, n_kv] int64: the sequences holding each cell, bit s for s
    q_pos: torch.Tensor  # [n_stream, n_q] int64: each query's position
    q_seq: torch.Tensor  # [n_stream, n_q] int64: each query's sequence (0..63)
    swa: str = "none"  # one of SWA_KINDS
    n_swa: int = 0  # the window (chunk) size for swa != "none"
    causal: bool = True  # a query sees no position after its own

    def __post_init__(self) -> None:
        assert self.swa in SWA_KINDS, self.swa
        assert self.swa == "none" or self.n_swa > 0, (self.swa, self.n_swa)
        assert self.pos.shape == self.seq.shape and self.q_pos.shape == self.q_seq.shape
        assert self.pos.shape[0] == self.q_pos.shape[0], (self.pos.shape, self.q_pos.shape)


def visible_ref(c: Cells) -> torch.Tensor:
    """[n_stream, n_q, n_kv] bool: whether query i of a stream sees cell j (the specification)."""
    cp, cs = c.pos[:, None, :], c.seq[:, None, :]  # [S, 1, n_kv]
    qp, qs = c.q_pos[:, :, None], c.q_seq[:, :, None]  # [S, n_q, 1]
    seen = (cp >= 0) & (((cs >> qs) & 1) == 1)
    if c.causal:
        seen &= cp <= qp
    if c.swa == "standard":
        seen &= qp - cp < c.n_swa
    elif c.swa == "chunked":
        seen &= cp >= torch.div(qp, c.n_swa, rounding_mode="floor") * c.n_swa
    elif c.swa == "symmetric":
        half = c.n_swa // 2
        seen &= (cp >= qp - half) & (cp <= qp + half)
    return seen


def visibility_mask(c: Cells) -> torch.Tensor:
    """[n_stream, n_q, n_kv] float32 additive mask: 0 where seen, -inf where not."""
    seen = visible_ref(c)
    return torch.zeros(seen.shape, device=seen.device).masked_fill(~seen, float("-inf"))


@jit
def _visible(cp, cs, qp, qs, n_swa, SWA: tl.constexpr, CAUSAL: tl.constexpr):
    # cp, cs [1, N] cell position / sequence bits; qp, qs [M, 1] query position / sequence:
    # visible_ref's rule on one tile, [M, N] bool. SWA is the index of the kind in SWA_KINDS.
    seen = (cp >= 0) & (((cs >> qs) & 1) == 1)
    if CAUSAL:
        seen = seen & (cp <= qp)
    if SWA == 1:
        seen = seen & (qp - cp < n_swa)
    if SWA == 2:
        seen = seen & (cp >= (qp // n_swa) * n_swa)  # positions are >= 0: // floors
    if SWA == 3:
        seen = seen & (cp >= qp - n_swa // 2) & (cp <= qp + n_swa // 2)
    return seen
