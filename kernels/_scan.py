"""What the two Mamba scans share (ssm_scan: Mamba-1's A per channel; ssd: Mamba-2's A per
head): ggml's softplus, the torch path that takes the step form for a single token, the step
form of a Triton scan, and the Triton wrappers' operands. Both take (s, x, dt, A, B, C) with the
tokens on dim 1 of x, dt, B and C, and return (y, states)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Scan = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (s, x, dt, A, B, C[, n_states]) -> (y, h)


def softplus(dt: torch.Tensor) -> torch.Tensor:
    """ggml's softplus: log1p(exp(x)), and x itself above 20."""
    return torch.where(dt > 20.0, dt, F.softplus(dt, threshold=20.0))


Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def scan_ref(step_ref: Scan, ref: Scan, ops: Operands, n_states: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path over a ubatch, `ops` = (s, x, dt, A, B, C): `ref`, or `step_ref` where it
    is a single token (decode)."""
    s, x, dt, A, B, C = ops
    if x.shape[1] == 1:
        y, h = step_ref(s, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
        return y[:, None], h[:, None]
    return ref(s, x, dt, A, B, C, n_states)


def step_of(scan: Scan, ops: Operands) -> tuple[torch.Tensor, torch.Tensor]:
    """The step form of `scan` (`ops` = (s, x, dt, A, B, C) of one token, no token dim): the
    scan over that one token."""
    s, x, dt, A, B, C = ops
    y, h = scan(s, x[:, None], dt[:, None], A, B[:, None], C[:, None])
    return y[:, 0], h[:, 0]


def f32_operands(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The operands as the Triton kernels read them: contiguous f32, all on one device."""
    out = [t.float().contiguous() for t in ts]
    assert all(t.device == out[0].device for t in out)
    return out
