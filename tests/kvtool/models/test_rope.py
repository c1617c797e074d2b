"""RoPE: the laid-out tables (complex for NORM, swap form for NEOX) against the textbook
rotation of each pair in float32.

NEOX computes the pair formula's exact operations, so its bits must match. NORM is one complex
multiply: torch's vectorized loop rounds as the formula does, its scalar loop may fuse a
multiply-add (one rounding fewer), so it is held to a float32 rounding of the result."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.models.rope import RopeParams, apply_rope


def classic(x: torch.Tensor, pos: torch.Tensor, p: RopeParams) -> torch.Tensor:
    """Pair (a, b) -> (a cos - b sin, a sin + b cos), float32 ops on float64-computed angles."""
    half = p.n_rot // 2
    inv = torch.tensor([p.base ** (-2.0 * i / p.n_rot) for i in range(half)], dtype=torch.float64)
    if p.freq_factors is not None:
        inv = inv / p.freq_factors.double()
    theta = pos.double()[:, None] * p.freq_scale * inv[None, :]
    c, s = torch.cos(theta).float()[:, None, :], torch.sin(theta).float()[:, None, :]
    out = x.clone()
    if p.neox:
        a, b = x[..., :half], x[..., half : p.n_rot]
        out[..., :half], out[..., half : p.n_rot] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0 : p.n_rot : 2], x[..., 1 : p.n_rot : 2]
        out[..., 0 : p.n_rot : 2], out[..., 1 : p.n_rot : 2] = a * c - b * s, a * s + b * c
    return out


def check(got: torch.Tensor, want: torch.Tensor, p: RopeParams) -> None:
    if p.neox:
        assert torch.equal(got, want)
    else:  # at most one float32 rounding of the largest term apart
        torch.testing.assert_close(got, want, rtol=0, atol=2.0**-23 * float(want.abs().max()))


@pytest.mark.parametrize("neox", [False, True], ids=["norm", "neox"])
@pytest.mark.parametrize("n_rot", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize(
    "positions",
    [[0, 1, 2, 3, 300, 7], [41], [-5, 3, -300], [200_000, 3]],
    ids=["prompt", "decode", "negative-deltas", "beyond-table"],
)
def test_matches_classic_rotation(neox: bool, n_rot: int, positions: list[int]) -> None:
    g = torch.Generator().manual_seed(n_rot + len(positions))
    factors = torch.rand(n_rot // 2, generator=g) + 0.5
    for p in (
        RopeParams(n_rot=n_rot, base=10000.0, neox=neox),
        RopeParams(n_rot=n_rot, base=500.0, freq_scale=0.25, neox=neox, freq_factors=factors),
    ):
        pos = torch.tensor(positions)
        x = torch.randn(len(positions), 3, 16, generator=g) * 4
        got = apply_rope(x, p.rotation(pos), p)
        check(got, classic(x, pos, p), p)


@pytest.mark.parametrize("offset", [24, 25], ids=["even-offset", "odd-offset"])
def test_strided_input_and_table_growth(offset: int) -> None:
    # q and k are column slices of one fused projection: rows are not contiguous (and an odd
    # start cannot be viewed as complex numbers)
    p = RopeParams(n_rot=8, base=10000.0)
    fused = torch.randn(4, 3 * 8 + 2 * 8 + 1)
    k = fused[:, offset : offset + 16].unflatten(-1, (2, 8))
    for pos in ([1, 2, 3, 4], [5000, 5001, 5002, 5003], [7, 8, 9, 10]):  # the table grows, then is reused
        t = torch.tensor(pos)
        check(apply_rope(k, p.rotation(t), p), classic(k, t, p), p)


def test_rotation_is_a_rotation() -> None:
    # the math: a pair keeps its length and turns by theta (here pos 1, the first pair: theta = 1)
    p = RopeParams(n_rot=4, base=10000.0, neox=False)
    x = torch.tensor([[[1.0, 0.0, 3.0, 4.0]]])
    y = apply_rope(x, p.rotation(torch.tensor([1])), p)[0, 0]
    assert y[0].item() == pytest.approx(math.cos(1.0), abs=1e-7)
    assert y[1].item() == pytest.approx(math.sin(1.0), abs=1e-7)
    assert torch.linalg.vector_norm(y[2:]).item() == pytest.approx(5.0, rel=1e-6)
