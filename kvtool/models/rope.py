"""Rotary position embedding as llama.cpp computes it (ggml_rope_ext, NORM and NEOX modes).

The tables are laid out once per ubatch in the form a head's dims take, so that a rotation is
one or two arithmetic ops per call instead of slicing and re-assembling every head per layer.
NORM rotates adjacent pairs: a head's rotated dims are complex numbers and the rotation is one
complex multiply by cos + i sin. NEOX pairs dim i with i + n_rot/2: x * cos + swap(x) * sin,
where swap exchanges the two halves and the tables hold each pair's cos at both members and its
sin with the sign of the member's term. Both give the float32 pair formula's bits
((a, b) -> (a cos - b sin, a sin + b cos), each product rounded, then the sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_ROPE_TABLE_MAX = 1 << 17  # positions beyond are computed directly, not tabled


@dataclass(frozen=True)
class Rotation:
    """The RoPE tables of some positions, in the form `apply_rope` rotates with."""

    cis: torch.Tensor | None = None  # NORM: [n, 1, n_rot/2] complex64, cos + i sin
    cos: torch.Tensor | None = None  # NEOX: [n, 1, n_rot], each pair's cos at both of its members
    sin: torch.Tensor | None = None  # NEOX: [n, 1, n_rot], -sin at a pair's first member, +sin at its second
    cs: torch.Tensor | None = None  # both modes: [n, n_rot/2, 2] each pair's (cos, sin), for compiled kernels


@dataclass(frozen=True)
class RopeParams:
    """llama.cpp's rope: `n_rot` dims rotated; NORM rotates adjacent pairs (2i, 2i+1),
    NEOX rotates (i, i + n_rot/2). theta_i = pos * freq_scale * base^(-2i/n_rot) / factor_i; the
    rotation is (cos, sin) theta_i, each times attn_factor."""

    n_rot: int
    base: float
    freq_scale: float = 1.0
    neox: bool = False
    freq_factors: torch.Tensor | None = None  # [n_rot/2] (rope_freqs.weight), divides theta
    attn_factor: float = 1.0  # cos and sin are scaled by it (ggml's mscale; phi3's LongRoPE)
    # the laid-out tables per position 0..len-1, computed once and grown by doubling: the same
    # float64 arithmetic as `_cos_sin`, so a table row is bit-identical to computing it afresh
    _table: list[tuple[torch.Tensor, ...]] = field(default_factory=list, compare=False, repr=False)

    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # in float64 on the CPU whatever the device, so that every device rotates alike (ggml's CPU
        # cache steps from pair to pair in float32: 4e-3 rad apart at 32k, docs/architecture.md)
        half = self.n_rot // 2
        inv = self.base ** (-2.0 * torch.arange(half, dtype=torch.float64) / self.n_rot)
        if self.freq_factors is not None:
            inv = inv / self.freq_factors.cpu().double()
        theta = pos.cpu().double()[:, None] * self.freq_scale * inv[None, :]
        cos, sin = torch.cos(theta).float(), torch.sin(theta).float()
        if self.attn_factor != 1.0:
            cos, sin = cos * self.attn_factor, sin * self.attn_factor
        return cos.to(pos.device), sin.to(pos.device)

    def _layout(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # [n, half] -> the tables of Rotation for this mode, [n, ...] (no head axis yet)
        if self.neox:  # pairs (i, i + half)
            return torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1), torch.stack([cos, sin], -1)
        return (torch.complex(cos, sin),)

    def _rotation(self, tables: tuple[torch.Tensor, ...]) -> Rotation:
        t = [x[:, None] for x in tables[:2]]  # [n, 1, ...]: one row for every head
        if self.neox:
            return Rotation(cos=t[0], sin=t[1], cs=tables[2])
        return Rotation(cis=t[0], cs=torch.view_as_real(tables[0]))

    def _tables(self, top: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The laid-out tables of positions 0..top at least, on `device` (grown by doubling)."""
        table = self._table[0] if self._table else None
        if table is None or top >= table[0].shape[0] or table[0].device != device:
            size = max(256, 1 << top.bit_length(), 0 if table is None else table[0].shape[0])
            self._table[:] = [self._layout(*self._cos_sin(torch.arange(size, device=device)))]
        return self._table[0]

    def reserve(self, bounds: tuple[int, int], device: torch.device) -> int | None:
        """Makes the table on `device` cover positions within `bounds` (`position_bounds`, on
        the host); returns its length, or None where a position is off the table (negative,
        huge: computed directly). A rotation on the device then gathers rows with no host sync."""
        lo, hi = bounds
        if hi < lo or lo < 0 or hi >= _ROPE_TABLE_MAX:
            return None
        return int(self._tables(hi, device)[0].shape[0])

    def rotation(self, pos: torch.Tensor, bounds: tuple[int, int] | None = None) -> Rotation:
        """The tables for positions (or position deltas) `pos` [n], on pos's device. `bounds`:
        their `position_bounds` known on the host, so that a device tensor is never read back."""
        if bounds is None:  # on a device: one read back (a shift's deltas)
            bounds = position_bounds(pos if pos.device.type == "cpu" else pos.cpu())
        lo, hi = bounds
        if pos.numel() == 0 or lo < 0 or hi >= _ROPE_TABLE_MAX:
            return self._rotation(
                self._layout(*self._cos_sin(pos))
            )  # negative deltas (seq_add), huge positions
        tables = self._tables(hi, pos.device)
        if pos.numel() == 1 and pos.device.type == "cpu":  # decode: views of one table row, no gather
            i = int(pos[0])
            return self._rotation(tuple(t[i : i + 1] for t in tables))
        return self._rotation(tuple(t[pos] for t in tables))


def position_bounds(pos: torch.Tensor | np.ndarray) -> tuple[int, int]:
    """The smallest and largest position (0, -1 for none); one position is read, not reduced."""
    n = pos.numel() if isinstance(pos, torch.Tensor) else pos.size
    if n <= 1:
        return (int(pos[0]), int(pos[0])) if n else (0, -1)
    return int(pos.min()), int(pos.max())


def apply_rope(x: torch.Tensor, rot: Rotation, p: RopeParams) -> torch.Tensor:
    """x [n, n_head, head_dim] rotated by `rot` (from `p.rotation`). Dims past n_rot pass through."""
    n_rot = p.n_rot
    xr = x if x.shape[-1] == n_rot else x[..., :n_rot]
    if rot.cis is not None:
        if xr.storage_offset() % 2 or any(st % 2 for st in xr.stride()[:-1]):
            xr = xr.contiguous()  # complex views need even offsets and strides
        out = torch.view_as_real(torch.view_as_complex(xr.unflatten(-1, (n_rot // 2, 2))) * rot.cis).flatten(
            -2
        )
    else:
        assert rot.cos is not None and rot.sin is not None
        swapped = xr.unflatten(-1, (2, n_rot // 2)).flip(-2).flatten(-2)
        # a*c + (-s)*b == a*c - b*s and b*c + s*a == a*s + b*c in IEEE float: the pair formula's bits
        out = xr * rot.cos
        out += swapped * rot.sin
    return out if x.shape[-1] == n_rot else torch.cat([out, x[..., n_rot:]], dim=-1)
