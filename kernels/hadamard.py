"""The Walsh-Hadamard rotation llama.cpp applies around a quantized K/V cache (torch, any device).

With a quantized K, llama.cpp multiplies Q and K by an orthonormal Hadamard matrix H of size n
(src/llama-graph.cpp, `attn_rot_k`) before K is stored: Q K^T is unchanged (H H^T = I) while
each K row's outliers are spread over its block, so it quantizes better; with a quantized V
it rotates V before the store and the attention output back (H is its own inverse). ggml's
CPU backend computes the product as a fast transform (ops.cpp, ggml_compute_forward_fwht):
each run of n values is scaled by 1 / sqrt(n) first, then butterflies of width 1, 2, 4, ...
take (u, v) to (u + v, u - v). `fwht` does those float32 operations in that order: its bits
are ggml's.
"""

from __future__ import annotations

import numpy as np
import torch


def fwht_scale(n: int) -> float:
    """ggml's 1.0f / sqrtf((float) n), as a float32 value."""
    return float(np.float32(1.0) / np.sqrt(np.float32(n)))


def fwht(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., D] with every run of n consecutive values (n a power of two dividing D) rotated
    by the n x n orthonormal Hadamard matrix (Sylvester's order). Returns a new float32 tensor."""
    if n < 1 or n & (n - 1) or x.shape[-1] % n:
        raise ValueError(f"a Hadamard rotation of size {n} does not fit rows of {x.shape[-1]}")
    y = x.float().reshape(-1, n) * fwht_scale(n)
    width = 1
    while width < n:
        y = y.view(-1, n // (2 * width), 2, width)
        u, v = y[:, :, 0], y[:, :, 1]
        y = torch.stack((u + v, u - v), dim=2)
        width *= 2
    return y.reshape(x.shape)
