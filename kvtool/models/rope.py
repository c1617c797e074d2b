"""Rotary position embedding as llama.cpp computes it (ggml_rope_ext, NORM and NEOX modes).

A rotation is applied as x * cos + swap(x) * sin, where swap exchanges the two members of each
rotated pair and the tables already hold each pair's cos at both members and its sin with the
sign of the member's term: one copy (the swap) and three arithmetic ops per call, with the
tables laid out once per ubatch instead of slicing and re-assembling every head per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_ROPE_TABLE_MAX = 1 << 17  # positions beyond are computed directly, not tabled


@dataclass(frozen=True)
class Rotation:
    """The RoPE tables of some positions, laid out like the rotated dims of one head."""

    cos: torch.Tensor  # [n, 1, n_rot]: each pair's cos at both of its members
    sin: torch.Tensor  # [n, 1, n_rot]: -sin at a pair's first member, +sin at its second


@dataclass(frozen=True)
class RopeParams:
    """llama.cpp's rope: `n_rot` dims rotated; NORM rotates adjacent pairs (2i, 2i+1),
    NEOX rotates (i, i + n_rot/2). theta_i = pos * freq_scale * base^(-2i/n_rot) / factor_i."""

    n_rot: int
    base: float
    freq_scale: float = 1.0
    neox: bool = False
    freq_factors: torch.Tensor | None = None  # [n_rot/2] (rope_freqs.weight), divides theta
    # the laid-out cos/sin per position 0..len-1, computed once and grown by doubling: the same
    # float64 arithmetic as `_cos_sin`, so a table row is bit-identical to computing it afresh
    _table: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, compare=False, repr=False)

    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # in float64 on the CPU whatever the device, so that every device rotates alike
        half = self.n_rot // 2
        inv = self.base ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.n_rot)
        if self.freq_factors is not None:
            inv = inv / self.freq_factors.cpu().double()
        theta = pos.cpu().double()[:, None] * self.freq_scale * inv[None, :]
        return torch.cos(theta).float().to(pos.device), torch.sin(theta).float().to(pos.device)

    def _layout(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [n, half] -> [n, n_rot] in the order of a head's rotated dims (see Rotation)
        if self.neox:  # pairs (i, i + half)
            return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
        return torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2)

    def rotation(self, pos: torch.Tensor) -> Rotation:
        """The tables for positions (or position deltas) `pos` [n], on pos's device."""
        if pos.numel() == 0 or int(pos.min()) < 0 or int(pos.max()) >= _ROPE_TABLE_MAX:
            cos, sin = self._layout(*self._cos_sin(pos))  # negative deltas (seq_add), huge positions
            return Rotation(cos[:, None, :], sin[:, None, :])
        top = int(pos.max())
        table = self._table[0] if self._table else None
        if table is None or top >= table[0].shape[0] or table[0].device != pos.device:
            size = max(256, 1 << top.bit_length(), 0 if table is None else table[0].shape[0])
            self._table[:] = [self._layout(*self._cos_sin(torch.arange(size, device=pos.device)))]
        cos, sin = self._table[0]
        if pos.numel() == 1:  # decode: a view of the table row, no gather
            i = int(pos[0])
            return Rotation(cos[i : i + 1, None, :], sin[i : i + 1, None, :])
        return Rotation(cos[pos][:, None, :], sin[pos][:, None, :])


def apply_rope(x: torch.Tensor, rot: Rotation, p: RopeParams) -> torch.Tensor:
    """x [n, n_head, head_dim] rotated by `rot` (from `p.rotation`). Dims past n_rot pass through."""
    n_rot = p.n_rot
    xr = x if x.shape[-1] == n_rot else x[..., :n_rot]
    if p.neox:
        swapped = xr.unflatten(-1, (2, n_rot // 2)).flip(-2).flatten(-2)
    else:
        swapped = xr.unflatten(-1, (n_rot // 2, 2)).flip(-1).flatten(-2)
    # a*c + (-s)*b == a*c - b*s and b*c + s*a == a*s + b*c in IEEE float: the classic formula's bits
    out = xr * rot.cos
    out += swapped * rot.sin
    return out if xr is x else torch.cat([out, x[..., n_rot:]], dim=-1)
